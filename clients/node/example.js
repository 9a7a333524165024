'use strict';
// Create a root session, prompt it, print the first N events of its whole tree, exit.
//
//   DSH_NODE=127.0.0.1:PORT DSH_CLUSTER_TOKEN=... node example.js [N] [PRESET] [PROMPT]
//
// N defaults to 20, PRESET to "lead", PROMPT to "Survey the coordination stack.".

const { connect, decodeError } = require('./lib/mesh');

function describe(event) {
  const where = `#${event.event_seq} ${event.session_id}`;
  if (event.activated) return `${where} activated on ${event.activated.node_id}`;
  if (event.deactivated) return `${where} deactivated on ${event.deactivated.node_id}`;
  const entry = event.entry;
  if (!entry) return `${where} (empty event)`;
  const body = entry[entry.body];
  switch (entry.body) {
    case 'task':
    case 'human_prompt':
      return `${where} ${entry.seq} ${entry.body}: ${JSON.stringify(body.content)}`;
    case 'agent_message':
      return `${where} ${entry.seq} message from ${body.source.sender_session_id} (${body.delivery}): ${JSON.stringify(body.content)}`;
    case 'settlement_notice':
      return `${where} ${entry.seq} ${body.child_session_id} settled ${body.outcome}: ${JSON.stringify(body.terminal_output)}`;
    case 'assistant_step': {
      const calls = body.tool_calls.map((c) => c.name).join(', ');
      return `${where} ${entry.seq} step: ${JSON.stringify(body.text)}${calls ? ` calls ${calls}` : ''}`;
    }
    case 'tool_result':
      return `${where} ${entry.seq} ${body.name} (${body.duration_ms} ms${body.is_error ? ', error' : ''}) -> ${JSON.stringify(body.content)}`;
    case 'turn_started':
      return `${where} ${entry.seq} turn ${body.turn_id} started`;
    case 'turn_ended':
      return `${where} ${entry.seq} turn ${body.turn_id} ended ${body.outcome}${body.output_json ? ` output ${body.output_json}` : ''}`;
    case 'answer_rejected':
      return `${where} ${entry.seq} answer asked again: ${JSON.stringify(body.reason)}`;
    case 'consumed':
      return `${where} ${entry.seq} consumed ${body.seqs.join(',')}`;
    case 'compaction':
      return `${where} ${entry.seq} compacted ${body.from_seq}-${body.through_seq}: ${JSON.stringify(body.summary)}`;
    case 'tool_outputs_cleared':
      return `${where} ${entry.seq} cleared tool outputs ${body.seqs.join(',')}`;
    case 'approval_request':
      return `${where} ${entry.seq} ${body.tool}(${body.arguments_json}) waits for approval (call ${body.call_id}, digest ${body.request_digest})`;
    case 'approval_decision':
      return `${where} ${entry.seq} call ${body.call_id} ${body.decision} by ${body.by}${body.reason ? `: ${body.reason}` : ''}`;
    default:
      return `${where} ${entry.seq} ${entry.body}`;
  }
}

async function main() {
  const address = process.env.DSH_NODE;
  if (!address || !process.env.DSH_CLUSTER_TOKEN) {
    console.error('set DSH_NODE (HOST:PORT of a node) and DSH_CLUSTER_TOKEN');
    return 2;
  }
  const [count = '20', preset = 'lead', text = 'Survey the coordination stack.'] =
    process.argv.slice(2);
  const client = connect(address); // the token comes from DSH_CLUSTER_TOKEN
  try {
    const root = await client.createRoot({ preset });
    console.log(`root ${root.session_id} on ${root.node_id}`);
    await client.prompt(root.session_id, text);
    let seen = 0;
    for await (const event of client.watch(root.session_id, { tree: true })) {
      console.log(describe(event));
      if (++seen >= Number(count)) break; // leaving the loop cancels the stream
    }
    return 0;
  } catch (err) {
    const e = decodeError(err);
    console.error(`error: ${e.reason || e.codeName}: ${e.detail ?? e.message}`);
    return 1;
  } finally {
    client.close();
  }
}

if (require.main === module) {
  main().then((code) => {
    process.exitCode = code;
  });
}

module.exports = { describe };
