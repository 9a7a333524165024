// The dsh-mesh web view: a live tree of agents spread over nodes, the selected agent's
// transcript, a timeline of turns, steps and tool calls, and the actions a person takes.
// Everything shown is derived from the tree's event stream (/api/events, server-sent events
// of WatchSession) and ListAgents (/api/agents); the server keeps no state.
'use strict';

const view = {
  config: { trace_url: '', node: '', prices: {} },
  root: null,
  agents: new Map(),   // session id -> agent (see newAgent)
  order: [],           // session ids, parents before children
  selected: null,
  source: null,
  lastEvent: 0,
  refetching: null,
  drawing: false,
  rootsAfter: '',      // the token the root list's page starts after ('' for the first page)
  rootsNext: '',       // the token of the page after it ('' on the last)
  rootsTotal: null,    // roots in all (the first page counts them)
  rootsSerial: 0,      // the latest root list asked for: an older answer is dropped
};

const $ = (selector) => document.querySelector(selector);

function newAgent(id) {
  return {
    id, info: null, node: '', nodes: [], ran: [], resident: false, running: false,
    settled: null, lastOutcome: null, usage: { input: 0, output: 0, cached: 0 },
    byModel: new Map(), firstCall: null, entries: [], turns: [], pending: new Map(),
    writing: '',  // the text of the step being written, from deltas (never stored)
    writes: 0,    // how many deltas and clears it had: what the transcript redraws on
  };
}

function agent(id, { listed = false } = {}) {
  let found = view.agents.get(id);
  if (!found) {
    found = newAgent(id);
    view.agents.set(id, found);
    if (!listed) scheduleRefetch();  // a descendant that appeared: its header is listed
  }
  return found;
}

// Positions and widths drawn as data attributes, set here through the CSSOM: the page's
// content-security policy allows no inline style attribute.
function placed(box) {
  for (const element of box.querySelectorAll('[data-left], [data-width]')) {
    if (element.dataset.left) element.style.left = element.dataset.left;
    if (element.dataset.width) element.style.width = element.dataset.width;
  }
}

// The page's key (its sign-in's CSRF token): from the launch link's fragment or the sign-in
// form, kept in this origin's storage (which no other port's page reads) and sent with every
// request. The sign-in cookie alone reads nothing: every server on this host receives it.
function pageKey() {
  const given = new URLSearchParams(window.location.hash.slice(1)).get('key');
  if (given) {
    localStorage.setItem('dsh-mesh-key', given);
    const url = new URL(window.location);
    url.hash = '';
    window.history.replaceState(null, '', url);
  }
  return localStorage.getItem('dsh-mesh-key') || '';
}

function signIn() {
  window.location.assign(`/sign-in${window.location.search}`);
}

async function api(path, body) {
  const headers = { 'X-CSRF-Token': view.key };
  const init = body === undefined ? { headers } : {
    method: 'POST',
    headers: { ...headers, 'Content-Type': 'application/json' },
    body: JSON.stringify(body),
  };
  const response = await fetch(path, init);
  if (response.status === 401) signIn();  // signed out: restarted, idle, a grant removed
  const data = await response.json();
  if (!response.ok) {
    throw new Error(`${data.error}: ${data.detail}`);
  }
  return data;
}

// -- the tree ------------------------------------------------------------------------------

async function loadAgents() {
  const { agents } = await api(`/api/agents?root=${encodeURIComponent(view.root)}`);
  for (const summary of agents) {
    const found = agent(summary.info.session_id, { listed: true });
    found.info = summary.info;
    if (summary.activation && !found.node) {
      moved(found, summary.activation.node_id);
      found.resident = true;
    }
  }
  view.order = agents.map((s) => s.info.session_id);
  draw();
}

function scheduleRefetch() {
  if (view.refetching || !view.root) return;
  view.refetching = setTimeout(async () => {
    view.refetching = null;
    try { await loadAgents(); } catch (error) { say(error.message, true); }
  }, 150);
}

function moved(found, node) {
  found.node = node;
  if (found.nodes[found.nodes.length - 1] !== node) found.nodes.push(node);
}

// Where it ran before where it is now: the nodes of its turns (its transcript), else the
// residency changes this page saw.
function movesOf(found) {
  const history = [...(found.ran.length ? found.ran : found.nodes)];
  if (history[history.length - 1] === found.node) history.pop();
  if (!history.length || (history.length === 1 && !found.node)) return '';
  return ` <span class="moves">(${history.map(escape).join(' → ')} →)</span>`;
}

function stateOf(found) {
  if (found.pending.size) return 'awaiting-approval';
  if (found.resident) return found.running ? 'running' : 'idle';
  if (found.settled === 'lost') return 'lost';
  if (found.settled) return 'settled';
  return 'absent';
}

// The tree's shape, once per draw: each agent's depth and the tokens of its subtree (view.order
// lists parents before their children, so one pass each way; a 1,000-agent tree draws in
// linear time).
function shape() {
  const depths = new Map();
  const subtree = new Map();
  const subtreeCost = new Map();
  for (const id of view.order) {
    const parent = view.agents.get(id)?.info?.parent_session;
    depths.set(id, parent && depths.has(parent) ? depths.get(parent) + 1 : 0);
    const found = view.agents.get(id);
    subtree.set(id, found ? found.usage.input + found.usage.output : 0);
    subtreeCost.set(id, found ? costOf(found) : { usd: 0, unpriced: 0 });
  }
  for (let i = view.order.length - 1; i >= 0; i -= 1) {
    const id = view.order[i];
    const parent = view.agents.get(id)?.info?.parent_session;
    if (parent && subtree.has(parent)) {
      subtree.set(parent, subtree.get(parent) + subtree.get(id));
      const mine = subtreeCost.get(id);
      const theirs = subtreeCost.get(parent);
      subtreeCost.set(parent, { usd: theirs.usd + mine.usd, unpriced: theirs.unpriced + mine.unpriced });
    }
  }
  return { depths, subtree, subtreeCost };
}

// -- cost: each call at the model that made it (a step at its agent's, a summary at its own) --

function countCall(found, model, usage) {
  const sum = found.byModel.get(model) || { input: 0, cached: 0, output: 0, calls: 0 };
  sum.input += usage.input_tokens;
  sum.cached += Math.min(usage.cached_input_tokens, usage.input_tokens);
  sum.output += usage.output_tokens;
  sum.calls += 1;
  found.byModel.set(model, sum);
}

function priced(model, sum) {
  const price = Object.hasOwn(view.config.prices, model) ? view.config.prices[model] : null;
  if (!price) return null;
  return ((sum.input - sum.cached) * price.input_usd_per_mtok
    + sum.cached * price.cached_input_usd_per_mtok + sum.output * price.output_usd_per_mtok) / 1e6;
}

function costOf(found) {
  const cost = { usd: 0, unpriced: 0 };
  for (const [model, sum] of found.byModel) {
    const usd = priced(model || found.info?.model || '', sum);
    if (usd === null) cost.unpriced += sum.calls; else cost.usd += usd;
  }
  return cost;
}

function money(cost) {
  if (!Object.keys(view.config.prices || {}).length) return '';
  if (cost.unpriced && !cost.usd) return 'unpriced';
  const usd = cost.usd < 1 ? `$${cost.usd.toFixed(4)}` : `$${cost.usd.toFixed(2)}`;
  return cost.unpriced ? `${usd} + ${cost.unpriced} unpriced` : usd;
}

function stepCost(found, model, usage) {
  if (!Object.keys(view.config.prices || {}).length) return '';
  const sum = { input: usage.input_tokens, cached: Math.min(usage.cached_input_tokens, usage.input_tokens), output: usage.output_tokens };
  const usd = priced(model || found?.info?.model || '', sum);
  return usd === null ? ' unpriced' : ` $${usd.toFixed(6)}`;
}

function short(id) { return id.length > 14 ? `${id.slice(0, 6)}…${id.slice(-6)}` : id; }
function number(n) { return n.toLocaleString('en'); }

function role(info) {
  if (!info) return '?';
  const kind = { 'root': 'root', 'continuable-child': 'child', 'one-shot-child': 'one-shot' }[info.kind] || info.kind;
  return info.fork_origin ? `${kind} (fork)` : kind;
}

function drawTree() {
  const body = $('#tree tbody');
  const rows = [];
  const { depths, subtree, subtreeCost } = shape();
  let tokens = 0;
  const total = { usd: 0, unpriced: 0 };
  for (const id of view.order) {
    const found = view.agents.get(id);
    if (!found) continue;
    tokens += found.usage.input + found.usage.output;
    const cost = costOf(found);
    total.usd += cost.usd;
    total.unpriced += cost.unpriced;
    const state = stateOf(found);
    const share = found.firstCall && found.firstCall.input_tokens
      ? `${Math.round((100 * found.firstCall.cached_input_tokens) / found.firstCall.input_tokens)}%` : '';
    const moves = movesOf(found);
    const detail = state === 'settled' ? ` ${found.settled}` : '';
    rows.push(`<tr data-session="${id}" data-state="${state}" data-node="${found.node}"`
      + `${id === view.selected ? ' class="selected"' : ''}>`
      + `<td class="id"><span class="indent" data-width="${depths.get(id) * 1.2}em"></span>${short(id)}</td>`
      + `<td>${role(found.info)}</td><td>${escape(found.info?.preset || '')}</td>`
      + `<td><span class="state" data-state="${state}">${state}${detail}</span></td>`
      + `<td>${moves}${escape(found.node || '')}</td>`
      + `<td>${number(found.usage.input)} / ${number(found.usage.output)}</td>`
      + `<td>${share}</td><td>${number(subtree.get(id))}</td>`
      + `<td class="cost">${money(cost)}</td><td class="cost">${money(subtreeCost.get(id))}</td></tr>`);
  }
  body.innerHTML = rows.join('');
  placed(body);
  const spent = money(total);
  $('#totals').textContent = `${view.order.length} agents, ${number(tokens)} tokens${spent ? `, ${spent}` : ''}`;
}

// -- approvals -----------------------------------------------------------------------------

function drawApprovals() {
  const box = $('#approvals');
  const cards = [];
  for (const id of view.order) {
    const found = view.agents.get(id);
    for (const request of found?.pending.values() || []) {
      const expires = request.expires_at ? ` · expires ${new Date(request.expires_at).toLocaleString()}` : '';
      cards.push(`<div class="approval" data-session="${id}" data-call="${escape(request.call_id)}">`
        + `<div><b>${escape(request.tool)}</b> by <span class="id">${short(id)}</span>${expires}</div>`
        + `<textarea rows="3" class="arguments">${escape(pretty(request.arguments_json))}</textarea>`
        + `<input class="reason" placeholder="reason (the model reads it if denied)">`
        + '<div class="buttons"><button class="approve">Approve</button>'
        + '<button class="deny danger">Deny</button></div></div>');
    }
  }
  // Redrawn only when what waits changed: a person may be typing in an editor.
  const key = cards.join('');
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  box.innerHTML = cards.length ? key : '<p class="empty">No call waits.</p>';
}

function pretty(json) {
  try { return JSON.stringify(JSON.parse(json), null, 1); } catch { return json; }
}

function compact(json) {
  try { return JSON.stringify(JSON.parse(json)); } catch { return json; }
}

async function decide(card, allow) {
  const found = view.agents.get(card.dataset.session);
  const request = found?.pending.get(card.dataset.call);
  if (!request) return;
  const reason = card.querySelector('.reason').value;
  const edited = compact(card.querySelector('.arguments').value);
  const body = { call_id: request.call_id, request_digest: request.request_digest, reason };
  if (allow && edited !== compact(request.arguments_json)) body.arguments_json = edited;
  try {
    const decided = await api(`/api/sessions/${found.id}/${allow ? 'approve' : 'deny'}`, body);
    say(`${allow ? 'approved' : 'denied'} ${request.tool} as ${decided.decided_by}`);
  } catch (error) {
    say(error.message, true);
  }
}

// -- the transcript ------------------------------------------------------------------------

function escape(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]));
}

function traceLink(traceparent) {
  const id = traceparent.split('-')[1];
  if (!id) return '';
  if (!view.config.trace_url) return ` <span class="trace">trace ${id}</span>`;
  return ` <a class="trace" target="_blank" href="${escape(view.config.trace_url.replace('{trace_id}', id))}">trace ${id}</a>`;
}

function describe(entry, found) {
  const body = entry.body;
  switch (body.type) {
    case 'task': return ['task', escape(body.content)];
    case 'human_prompt': return ['prompt', escape(body.content)];
    case 'agent_message':
      return ['message', `from ${short(body.sender)} (${body.delivery || '?'}): ${escape(body.content)}${body.trace ? traceLink(body.trace) : ''}`];
    case 'settlement_notice':
      return ['settled', `${short(body.child_session)} ${body.outcome}${body.detail ? `: ${escape(body.detail)}` : ''} ${body.output_json ? `output ${escape(body.output_json)}` : escape(body.terminal_output)}`, body.outcome !== 'completed'];
    case 'assistant_step': {
      const calls = body.tool_calls.map((c) => `${escape(c.name)}(${escape(c.arguments_json)})`).join('; ');
      return ['step', `${escape(body.text)}${calls ? ` → ${calls}` : ''} [in ${body.usage.input_tokens} / cached ${body.usage.cached_input_tokens} / out ${body.usage.output_tokens}]${stepCost(found, '', body.usage)}`];
    }
    case 'tool_result':
      return ['tool', `${escape(body.name)} (${body.duration_ms} ms): ${escape(body.content)}`, body.is_error];
    case 'turn_started':
      return ['turn', `${body.turn_id} started on ${body.node_id || '?'}${body.trace ? traceLink(body.trace) : ''}`];
    case 'turn_ended':
      return ['turn', `${body.turn_id} ended ${body.outcome}${body.detail ? `: ${escape(body.detail)}` : ''}${body.output_json ? `, output ${escape(body.output_json)}` : ''}`, !['completed', 'awaiting-approval'].includes(body.outcome)];
    case 'answer_rejected': return ['rejected', `answer asked again: ${escape(body.reason)}`, true];
    case 'consumed': return ['read', `seq ${body.seqs.join(', ')}`];
    case 'fork_prefix': return ['inherited', `${body.messages.length} messages inherited from its parent`];
    case 'compaction': return ['compacted', `seq ${body.from_seq}-${body.through_seq}: ${escape(body.summary)}${stepCost(found, body.model, body.usage)}`];
    case 'tool_outputs_cleared': return ['cleared', `tool outputs of seq ${body.seqs.join(', ')}`];
    case 'approval_request': return ['approval?', `${escape(body.tool)}(${escape(body.arguments_json)}) call ${escape(body.call_id)}`];
    case 'approval_decision':
      return ['decided', `call ${escape(body.call_id)} ${body.decision} by ${escape(body.by)}${body.reason ? `: ${escape(body.reason)}` : ''}`, body.decision === 'deny'];
    default: return ['entry', '(unknown)'];
  }
}

function drawTranscript() {
  const list = $('#transcript');
  const found = view.agents.get(view.selected);
  $('#selected-id').textContent = view.selected || '';
  if (!found) { list.innerHTML = ''; return; }
  const writing = found.writing || '';
  // Redrawn on each delta by its count: the text's length stops changing once it is capped.
  const same = Number(list.dataset.count) === found.entries.length && list.dataset.session === found.id;
  if (same && list.dataset.writes === String(found.writes)) return;
  const line = list.querySelector('li.writing');
  if (same && writing && line) {
    // Only the step being written changed: its line alone, not every entry again.
    list.dataset.writes = String(found.writes);
    line.lastChild.textContent = ` ${writing}`;
    list.scrollTop = list.scrollHeight;
    return;
  }
  list.dataset.count = found.entries.length;
  list.dataset.session = found.id;
  list.dataset.writes = String(found.writes);
  list.innerHTML = found.entries.map((entry) => {
    const [kind, text, bad] = describe(entry, found);
    const when = entry.recorded_at ? new Date(entry.recorded_at).toLocaleTimeString() : '';
    return `<li value="${entry.seq}" data-kind="${entry.body.type}"${bad ? ' class="bad"' : ''}>`
      + `<span class="when">${when}</span> <span class="kind">${kind}</span> ${text}</li>`;
  }).join('') + (writing
    ? `<li class="writing" data-kind="writing"><span class="when"></span> <span class="kind">writing</span> ${escape(writing)}</li>`
    : '');
  list.scrollTop = list.scrollHeight;
}

// -- the timeline --------------------------------------------------------------------------

// The time axis: a tick every round step (so that at most eight fit), labelled from the
// first turn's start, whose clock time the lane's label shows.
const TICK_STEPS_S = [0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400];

function clock(seconds) {
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 60) return `${Number(seconds.toFixed(1))} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min${seconds % 60 ? ` ${Math.round(seconds % 60)} s` : ''}`;
  return `${Math.floor(seconds / 3600)} h${seconds % 3600 ? ` ${Math.round((seconds % 3600) / 60)} min` : ''}`;
}

function axis(start, span, at) {
  const seconds = span / 1000;
  const step = TICK_STEPS_S.find((s) => seconds / s <= 8) || TICK_STEPS_S[TICK_STEPS_S.length - 1];
  const ticks = [];
  for (let t = 0; t <= seconds + 1e-9; t += step) {
    ticks.push(`<div class="tick" data-left="${at(start + t * 1000)}">${t ? `+${clock(t)}` : '0'}</div>`);
  }
  const began = new Date(start).toLocaleTimeString();
  return `<div class="lane axis"><div class="label" title="when the first turn shown began">${began}</div><div class="track">${ticks.join('')}</div></div>`;
}

function drawTimeline() {
  let start = Infinity;
  let end = -Infinity;
  for (const found of view.agents.values()) {
    for (const turn of found.turns) {
      start = Math.min(start, turn.start);
      end = Math.max(end, turn.end ?? Date.now());
    }
  }
  const box = $('#timeline');
  if (start === Infinity) { box.innerHTML = ''; return; }
  const span = Math.max(end - start, 1);
  const at = (t) => `${(100 * (t - start)) / span}%`;
  const width = (a, b) => `${Math.max((100 * (b - a)) / span, 0.15)}%`;
  const lanes = [axis(start, span, at)];
  for (const id of view.order) {
    const found = view.agents.get(id);
    if (!found || !found.turns.length) continue;
    const bars = [];
    for (const turn of found.turns) {
      const stop = turn.end ?? Date.now();
      const trace = turn.trace ? turn.trace.split('-')[1] : '';
      bars.push(`<div class="bar turn" data-outcome="${turn.outcome || 'running'}" data-trace="${trace}" data-left="${at(turn.start)}" data-width="${width(turn.start, stop)}" title="turn ${turn.id} on ${turn.node}: ${turn.outcome || 'running'}${trace ? `, trace ${trace} (click)` : ''}"></div>`);
      for (const step of turn.steps) bars.push(`<div class="bar step" data-left="${at(step)}" title="step"></div>`);
      for (const call of turn.tools) {
        bars.push(`<div class="bar tool" data-error="${call.error}" data-left="${at(call.start)}" data-width="${width(call.start, call.end)}" title="${escape(call.name)} ${call.end - call.start} ms"></div>`);
      }
    }
    lanes.push(`<div class="lane" data-session="${id}"><div class="label">${short(id)}</div><div class="track">${bars.join('')}</div></div>`);
  }
  box.innerHTML = lanes.join('');
  placed(box);
}

// -- events --------------------------------------------------------------------------------

// The most characters of a step being written the page keeps (the newest): a step that never
// lands (its model call failed) cannot grow it without bound.
const WRITING_MAX_CHARS = 65536;

function apply(event) {
  view.lastEvent = Math.max(view.lastEvent, event.event_seq);
  if (window.dshProbe) window.dshProbe(event);  // a benchmark's hook (bench/view.py)
  const found = agent(event.session_id);
  if (event.activated) {
    moved(found, event.activated.node_id);
    found.resident = true;
    found.settled = null;
  }
  if (event.deactivated && found.node === event.deactivated.node_id) {
    found.resident = false;
    found.running = false;
  }
  if (event.delta) {
    // The step being written (ADR 0053): shown until the stored step lands, never kept.
    const lost = event.delta.dropped ? `[${event.delta.dropped} lost]` : '';
    found.writing = ((found.writing || '') + lost + event.delta.text).slice(-WRITING_MAX_CHARS);
    found.writes += 1;
    return;
  }
  const entry = event.entry;
  if (!entry) return;
  found.entries.push(entry);
  const body = entry.body;
  // The stored step replaces what was seen of it; a turn that ended without one drops it too.
  if ((body.type === 'assistant_step' || body.type === 'turn_ended') && found.writing) {
    found.writing = '';
    found.writes += 1;
  }
  const when = entry.recorded_at ? Date.parse(entry.recorded_at) : Date.now();
  const turn = found.turns[found.turns.length - 1];
  switch (body.type) {
    case 'turn_started':
      // Where each turn ran is durable: the agent's moves read from its transcript, so a
      // page opened after a move still shows it (residency events tell only the present,
      // and keep found.node: where it is now).
      if (body.node_id && found.ran[found.ran.length - 1] !== body.node_id) found.ran.push(body.node_id);
      found.running = true;
      found.turns.push({ id: body.turn_id, node: body.node_id, trace: body.trace, start: when, end: null, outcome: null, steps: [], tools: [] });
      break;
    case 'turn_ended':
      found.running = false;
      found.lastOutcome = body.outcome;
      if (turn && turn.id === body.turn_id) { turn.end = when; turn.outcome = body.outcome; }
      break;
    case 'assistant_step':
      countCall(found, '', body.usage);
      found.usage.input += body.usage.input_tokens;
      found.usage.output += body.usage.output_tokens;
      found.usage.cached += body.usage.cached_input_tokens;
      if (!found.firstCall) found.firstCall = body.usage;
      if (turn) turn.steps.push(when);
      break;
    case 'compaction':
      countCall(found, body.model || '', body.usage);
      found.usage.input += body.usage.input_tokens;
      found.usage.output += body.usage.output_tokens;
      break;
    case 'tool_result':
      if (turn) turn.tools.push({ name: body.name, start: when - body.duration_ms, end: when, error: body.is_error });
      found.pending.delete(body.call_id);
      break;
    case 'approval_request':
      found.pending.set(body.call_id, body);
      break;
    case 'approval_decision':
      found.pending.delete(body.call_id);
      break;
    case 'settlement_notice': {
      // The child's activation ended (how: the outcome); a later activation shows again.
      const child = agent(body.child_session);
      child.settled = body.outcome;
      child.resident = false;
      child.running = false;
      break;
    }
    default:
      break;
  }
}

function draw() {
  if (view.drawing) return;
  view.drawing = true;
  requestAnimationFrame(() => {
    view.drawing = false;
    drawTree();
    drawApprovals();
    drawTranscript();
    drawTimeline();
  });
}

function listen() {
  if (view.source) view.source.close();
  const source = new EventSource(`/api/events?root=${encodeURIComponent(view.root)}&after=${view.lastEvent}&key=${encodeURIComponent(view.key)}`);
  view.source = source;
  source.onopen = () => connection('live');
  source.onmessage = (message) => {
    apply(JSON.parse(message.data));
    draw();
  };
  source.addEventListener('error', (message) => {
    if (message.data) say(JSON.parse(message.data).detail, true);
    connection('lost');
  });
}

function connection(state) {
  const badge = $('#connection');
  badge.dataset.state = state;
  badge.textContent = state;
}

function say(text, bad = false) {
  const box = $('#message');
  box.textContent = text;
  box.className = bad ? 'error' : '';
}

// -- actions -------------------------------------------------------------------------------

async function act(path, body, done) {
  if (!view.selected) { say('select an agent first', true); return; }
  try {
    const result = await api(`/api/sessions/${view.selected}/${path}`, body);
    say(done(result));
  } catch (error) {
    say(error.message, true);
  }
}

function wire() {
  $('#sign-out').addEventListener('click', async () => {
    await api('/api/sign-out', {}).catch(() => {});
    localStorage.removeItem('dsh-mesh-key');
    signIn();
  });
  $('#tree tbody').addEventListener('click', (click) => {
    const row = click.target.closest('tr');
    if (!row) return;
    view.selected = row.dataset.session;
    draw();
  });
  $('#approvals').addEventListener('click', (click) => {
    const card = click.target.closest('.approval');
    if (!card) return;
    if (click.target.classList.contains('approve')) decide(card, true);
    if (click.target.classList.contains('deny')) decide(card, false);
  });
  $('#prompt-send').addEventListener('click', () => {
    const text = $('#prompt-text').value;
    act('prompt', { text }, (r) => `prompt accepted at seq ${r.accepted_seq}`);
    $('#prompt-text').value = '';
  });
  $('#interrupt').addEventListener('click', () => act('interrupt', {}, (r) => (r.interrupted ? `interrupted turn ${r.turn_id}` : 'nothing to interrupt')));
  $('#stop-tree').addEventListener('click', () => act('stop', { close: $('#stop-close').checked, reason: $('#stop-reason').value }, (r) => `stopped the subtree of ${short(r.session_id)}${r.closed ? ' (closed)' : ''}`));
  $('#reopen-tree').addEventListener('click', () => act('reopen', {}, (r) => (r.reopened ? 'reopened' : 'nothing was stopped')));
  $('#timeline').addEventListener('click', (click) => {
    // A turn's bar opens its trace (its steps, model calls and tool calls are spans of it).
    const trace = click.target.dataset?.trace;
    if (trace && view.config.trace_url) window.open(view.config.trace_url.replace('{trace_id}', trace), '_blank');
  });
}

// -- the root list: one page at a time, filtered by the node, asked again while shown ---------

const ROOTS_POLL_MS = 3000;
const ROOT_FILTERS = [['prefix', '#root-prefix'], ['preset', '#root-preset'], ['namespace', '#root-namespace'], ['state', '#root-state']];

function when(stamp) {
  return stamp ? new Date(stamp).toLocaleString() : '';
}

async function loadRoots() {
  const query = new URLSearchParams();
  for (const [name, selector] of ROOT_FILTERS) {
    const value = $(selector).value.trim();
    if (value) query.set(name, value);
  }
  if (view.rootsAfter) query.set('after', view.rootsAfter);
  const serial = ++view.rootsSerial;
  const data = await api(`/api/roots?${query}`);
  if (serial !== view.rootsSerial) return null;  // a filter typed meanwhile: its answer wins
  if (data.total !== null && data.total !== undefined) view.rootsTotal = data.total;
  view.rootsNext = data.next;
  drawRoots(data.roots);
  return data.roots;
}

function drawRoots(roots) {
  $('#roots tbody').innerHTML = roots.map((r) => {
    const id = r.info.session_id;
    const state = r.activation ? (r.state || 'resident') : 'absent';
    return `<tr data-session="${escape(id)}"${id === view.root ? ' class="selected"' : ''}>`
      + `<td class="id" title="${escape(id)}">${escape(short(id))}</td>`
      + `<td>${escape(r.info.preset)}</td><td>${escape(r.info.namespace || '')}</td>`
      + `<td><span class="state" data-state="${escape(state)}">${escape(state)}</span></td>`
      + `<td>${escape(r.activation?.node_id || '')}</td><td>${escape(when(r.info.created_at))}</td></tr>`;
  }).join('');
  $('#roots-total').textContent = view.rootsTotal === null ? '' : `${number(view.rootsTotal)} in all`;
  let note = '';
  if (!roots.length) note = view.rootsNext ? 'none in this stretch: the next page looks further' : 'none';
  $('#roots-page').textContent = note;
  $('#roots-next').disabled = !view.rootsNext;
  $('#roots-first').disabled = !view.rootsAfter;
}

function pageOfRoots(after) {
  view.rootsAfter = after;
  loadRoots().catch((error) => say(error.message, true));
}

function wireRoots() {
  let typing = null;
  for (const [, selector] of ROOT_FILTERS) {
    $(selector).addEventListener('input', () => {
      clearTimeout(typing);
      typing = setTimeout(() => pageOfRoots(''), 250);
    });
  }
  $('#roots-next').addEventListener('click', () => pageOfRoots(view.rootsNext));
  $('#roots-first').addEventListener('click', () => pageOfRoots(''));
  $('#roots tbody').addEventListener('click', (click) => {
    const row = click.target.closest('tr');
    if (row) choose(row.dataset.session);
  });
  // Live: the page shown is asked again while the tab is visible (a first page costs the
  // node the same however many roots there are).
  setInterval(() => {
    if (!document.hidden) loadRoots().catch(() => connection('lost'));
  }, ROOTS_POLL_MS);
}

async function choose(root) {
  view.root = root;
  view.agents = new Map();
  view.order = [];
  view.lastEvent = 0;
  view.selected = root;
  $('#current-root').textContent = `tree ${root}`;
  for (const row of document.querySelectorAll('#roots tbody tr')) {
    row.classList.toggle('selected', row.dataset.session === root);
  }
  const url = new URL(window.location);
  url.searchParams.set('root', root);
  window.history.replaceState(null, '', url);
  await loadAgents();
  listen();
}

async function start() {
  view.key = pageKey();
  if (!view.key) { signIn(); return; }
  wire();
  view.config = await api('/api/config');
  if (view.config.prices_unavailable) say(`costs unavailable: ${view.config.prices_unavailable}`, true);
  $('#node').textContent = `node ${view.config.node}`;
  $('#person').textContent = `signed in as ${view.config.person.name}`;
  wireRoots();
  const roots = await loadRoots();
  const asked = new URL(window.location).searchParams.get('root');
  const root = asked || roots?.[0]?.info.session_id;
  if (root) {
    await choose(root);
  } else {
    say('no tree yet: create a root (dsh-mesh spawn), then reload');
  }
}

start().catch((error) => say(error.message, true));
