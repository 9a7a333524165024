'use strict';
// A small Node.js client for the public dsh-mesh contract (proto/dsh/mesh/v1/mesh.proto).
//
// The .proto is loaded at run time with @grpc/proto-loader (no generated code, no build step).
// Messages are plain objects exactly as on the wire: field names in snake_case (keepCase),
// 64-bit integers as decimal strings (seq, event_seq, accepted_seq...: compare them with
// BigInt), enums as their names ("AGENT_STATE_IDLE"), defaults filled in, and the set member of
// a oneof named in a virtual field (TranscriptEntry.body = "agent_message", ...).
//
// Every unary helper returns a promise that rejects with the grpc-js ServiceError; read the
// mesh's reason with decodeError(err) (docs/errors.md: google.rpc.Status in the trailer
// grpc-status-details-bin, ErrorInfo of domain "dsh.mesh.v1").

const crypto = require('node:crypto');
const fs = require('node:fs');
const path = require('node:path');

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const MESH_DOMAIN = 'dsh.mesh.v1';
const TOKEN_HEADER = 'x-dsh-cluster-token';
const NODE_HEADER = 'x-dsh-node';
const STATUS_DETAILS_HEADER = 'grpc-status-details-bin';
const TOKEN_ENV = 'DSH_CLUSTER_TOKEN';
const DEFAULT_CLIENT_NAME = 'dsh-mesh-node-client';
const DEFAULT_DEADLINE_MS = 30_000;

// The repository's proto/ (the contract) and this package's copy of the google.rpc protos
// (google/rpc/status.proto and error_details.proto, which no npm dependency ships).
const DEFAULT_PROTO_DIR = process.env.DSH_MESH_PROTO_DIR
  ? path.resolve(process.env.DSH_MESH_PROTO_DIR)
  : path.resolve(__dirname, '..', '..', '..', 'proto');
const LOCAL_PROTO_DIR = path.resolve(__dirname, '..', 'proto');
const MESH_PROTO = 'dsh/mesh/v1/mesh.proto';
const RPC_PROTOS = ['google/rpc/status.proto', 'google/rpc/error_details.proto'];

// proto-loader conversion options, also used to turn decoded error details into objects.
const LOADER_OPTIONS = Object.freeze({
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
});

const codeNames = Object.fromEntries(
  Object.entries(grpc.status).filter(([, v]) => typeof v === 'number').map(([k, v]) => [v, k]),
);

const cache = new Map();

/** Loads the contract once per proto directory: the gRPC services and dsh.mesh.v1.Rejection. */
function load(protoDir = DEFAULT_PROTO_DIR) {
  const key = path.resolve(protoDir);
  if (cache.has(key)) return cache.get(key);
  const includeDirs = [key, LOCAL_PROTO_DIR];
  if (!fs.existsSync(path.join(key, MESH_PROTO))) {
    throw new Error(`${MESH_PROTO} not found under ${key} (set protoDir or DSH_MESH_PROTO_DIR)`);
  }
  // Well-known google/protobuf types come bundled with protobufjs and proto-loader.
  const definition = protoLoader.loadSync(MESH_PROTO, { ...LOADER_OPTIONS, includeDirs });
  const v1 = grpc.loadPackageDefinition(definition).dsh.mesh.v1;

  const Rejection = protobufRoot([MESH_PROTO], includeDirs).lookupType('dsh.mesh.v1.Rejection');
  const loaded = { MeshControl: v1.MeshControl, AgentMesh: v1.AgentMesh, Rejection };
  cache.set(key, loaded);
  return loaded;
}

/** A protobufjs root of `files`, resolved against `includeDirs` (for decoding error details). */
function protobufRoot(files, includeDirs) {
  const root = new protobuf.Root();
  root.resolvePath = (_origin, target) => {
    if (path.isAbsolute(target)) return target;
    for (const dir of includeDirs) {
      const full = path.join(dir, target);
      if (fs.existsSync(full)) return full;
    }
    return target;
  };
  root.loadSync(files, { keepCase: true });
  root.resolveAll();
  return root;
}

let rpcTypes = null;

/** google.rpc.Status, ErrorInfo and RetryInfo, from this package's own copies. */
function errorTypes() {
  if (rpcTypes === null) {
    const root = protobufRoot(RPC_PROTOS, [LOCAL_PROTO_DIR]);
    rpcTypes = {
      Status: root.lookupType('google.rpc.Status'),
      ErrorInfo: root.lookupType('google.rpc.ErrorInfo'),
      RetryInfo: root.lookupType('google.rpc.RetryInfo'),
    };
  }
  return rpcTypes;
}

function toObject(type, bytes) {
  return type.toObject(type.decode(bytes), LOADER_OPTIONS);
}

/**
 * Reads the mesh's refusal out of a failed call (a grpc-js ServiceError).
 *
 * Returns {code, codeName, reason, domain, message, metadata, mesh, detail, rejection,
 * retryDelayMs}: `code` is the numeric gRPC status (7 = PERMISSION_DENIED...), `reason` and
 * `domain` come from the google.rpc.ErrorInfo in the grpc-status-details-bin trailer (the one of
 * domain "dsh.mesh.v1" when there is one), `message` is the status message. `mesh` is true only
 * when that ErrorInfo is the mesh's: otherwise the gRPC runtime, a proxy or a deadline produced
 * the status, and only `code` means anything (reason and domain are then null unless some other
 * ErrorInfo was sent). `retryDelayMs` is set for retryable reasons. `rejection` (the typed
 * dsh.mesh.v1.Rejection) needs mesh.proto from `protoDir`; reason and domain do not. Never throws.
 */
function decodeError(err, { protoDir } = {}) {
  const code = err && typeof err.code === 'number' ? err.code : grpc.status.UNKNOWN;
  const out = {
    code,
    codeName: codeNames[code] || 'UNKNOWN',
    reason: null,
    domain: null,
    message: err ? String(err.details ?? err.message ?? err) : '',
    metadata: {},
    mesh: false,
    detail: null,
    rejection: null,
    retryDelayMs: null,
  };
  const trailers = err && err.metadata && typeof err.metadata.get === 'function' ? err.metadata : null;
  const blobs = trailers ? trailers.get(STATUS_DETAILS_HEADER) : [];
  if (!blobs.length) return out;
  let types;
  try {
    types = errorTypes();
  } catch {
    return out; // this package's google/rpc protos are missing: only the code is known
  }
  for (const blob of blobs) {
    let status;
    try {
      status = types.Status.decode(Buffer.isBuffer(blob) ? blob : Buffer.from(String(blob), 'base64'));
    } catch {
      continue;
    }
    if (status.message) out.message = status.message;
    for (const any of status.details || []) {
      const name = String(any.type_url || '').slice(String(any.type_url || '').lastIndexOf('/') + 1);
      try {
        if (name === 'google.rpc.ErrorInfo') {
          const info = toObject(types.ErrorInfo, any.value);
          if (!out.mesh && (out.reason === null || info.domain === MESH_DOMAIN)) {
            out.reason = info.reason;
            out.domain = info.domain;
            out.metadata = { ...(info.metadata || {}) };
            out.mesh = info.domain === MESH_DOMAIN;
          }
        } else if (name === 'dsh.mesh.v1.Rejection') {
          out.rejection = toObject(load(protoDir).Rejection, any.value);
          out.detail = out.rejection.detail;
        } else if (name === 'google.rpc.RetryInfo') {
          const delay = toObject(types.RetryInfo, any.value).retry_delay;
          if (delay) out.retryDelayMs = Number(delay.seconds) * 1000 + Math.round(delay.nanos / 1e6);
        }
      } catch {
        // An undecodable detail is skipped; the others still count.
      }
    }
  }
  return out;
}

function unary(client, method, request, metadata, deadlineMs) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline: Date.now() + deadlineMs }, (err, response) =>
      err ? reject(err) : resolve(response),
    );
  });
}

/**
 * Connects to one node. `address` is its HOST:PORT.
 *
 * Options: `token` (the cluster token; undefined reads DSH_CLUSTER_TOKEN, null or "" sends none,
 * and every MeshControl call is then refused UNAUTHENTICATED), `node` (the caller's name, sent as
 * x-dsh-node; default "dsh-mesh-node-client"), `deadlineMs` (per unary call, default 30 s),
 * `credentials` (grpc ChannelCredentials; default insecure), `protoDir` (where
 * dsh/mesh/v1/mesh.proto lives; default the repository's proto/ or DSH_MESH_PROTO_DIR).
 *
 * Every method takes an optional last argument `{token, node, deadlineMs}` that overrides the
 * connection's for that one call (sendMessage uses it to act as a given node in tests).
 */
function connect(address, options = {}) {
  if (!address) throw new Error('a node address (HOST:PORT) is required');
  const {
    token = process.env[TOKEN_ENV],
    node = DEFAULT_CLIENT_NAME,
    deadlineMs = DEFAULT_DEADLINE_MS,
    credentials = grpc.credentials.createInsecure(),
    protoDir = DEFAULT_PROTO_DIR,
  } = options;
  const loaded = load(protoDir);
  const control = new loaded.MeshControl(address, credentials);
  const mesh = new loaded.AgentMesh(address, credentials, { channelOverride: control.getChannel() });

  function metadataFor(call = {}) {
    const md = new grpc.Metadata();
    const callToken = 'token' in call ? call.token : token;
    const callNode = 'node' in call ? call.node : node;
    if (callToken) md.set(TOKEN_HEADER, callToken);
    if (callNode) md.set(NODE_HEADER, callNode);
    return md;
  }
  const call = (client, method, request, opts = {}) =>
    unary(client, method, request, metadataFor(opts), opts.deadlineMs ?? deadlineMs);

  return {
    address,

    /** CreateRootSession. Resolves {session_id, activation_id, node_id}. A retry with the same
     * requestId returns the same session; without one a fresh key is used. `namespace` is the
     * new tree's (every child of it is in the same one; empty: "default"). */
    createRoot(
      { preset, initialTask = '', model = '', requestId = crypto.randomUUID(), nodeId = '', namespace = '' } = {},
      opts,
    ) {
      return call(
        control,
        'CreateRootSession',
        { preset, model, initial_task: initialTask, request_id: requestId, node_id: nodeId, namespace },
        opts,
      );
    },

    /** SubmitPrompt (Queue delivery: its own turn). Resolves {accepted_seq, duplicate}. */
    prompt(sessionId, text, { idempotencyKey = crypto.randomUUID() } = {}, opts) {
      return call(
        control,
        'SubmitPrompt',
        { session_id: sessionId, text, idempotency_key: idempotencyKey },
        opts,
      );
    },

    /**
     * ResolveApproval: allow the call `callId` that waits for approval (an approval_request
     * entry), naming the request it was shown (`requestDigest`); with `argumentsJson` it runs
     * with those arguments instead. Resolves {accepted_seq, duplicate, decided_by}. A call that
     * no longer waits is refused (decodeError(err).reason === 'APPROVAL_STALE').
     */
    approve(sessionId, callId, requestDigest, { argumentsJson = '', reason = '' } = {}, opts) {
      return call(
        control,
        'ResolveApproval',
        {
          session_id: sessionId,
          call_id: callId,
          decision: argumentsJson ? 'APPROVAL_DECISION_EDIT' : 'APPROVAL_DECISION_ALLOW',
          request_digest: requestDigest,
          arguments_json: argumentsJson,
          reason,
        },
        opts,
      );
    },

    /** ListApprovals: {approvals: [{session_id, seq, requested_at, request}]}: every call of
     * the tree rooted at rootSessionId that waits for a person's decision now. */
    listApprovals(rootSessionId, opts) {
      return call(control, 'ListApprovals', { root_session_id: rootSessionId }, opts);
    },

    /** ResolveApproval, denying: the call never runs; the model reads `reason`. */
    deny(sessionId, callId, requestDigest, { reason = '' } = {}, opts) {
      return call(
        control,
        'ResolveApproval',
        {
          session_id: sessionId,
          call_id: callId,
          decision: 'APPROVAL_DECISION_DENY',
          request_digest: requestDigest,
          reason,
        },
        opts,
      );
    },

    /** Interrupt the current turn. Resolves {interrupted, turn_id}. */
    interrupt(sessionId, opts) {
      return call(control, 'Interrupt', { session_id: sessionId }, opts);
    },

    /** GetSession: {header, activation (null when absent), transcript, next_page_token, state}. */
    getSession(sessionId, { pageSize = 0, pageToken = '' } = {}, opts) {
      return call(
        control,
        'GetSession',
        { session_id: sessionId, page_size: pageSize, page_token: pageToken },
        opts,
      );
    },

    /**
     * ListAgents: {agents: [{header, activation, state}], next_page_token}: the agents the
     * credential may see; `namespace` keeps only that one's (NAMESPACE_DENIED without a grant).
     */
    listAgents(
      { rootSessionId = '', residentOnly = false, pageSize = 0, pageToken = '', namespace = '' } = {},
      opts,
    ) {
      return call(
        control,
        'ListAgents',
        {
          root_session_id: rootSessionId,
          resident_only: residentOnly,
          page_size: pageSize,
          page_token: pageToken,
          namespace,
        },
        opts,
      );
    },

    /**
     * WatchSession as an async iterator of SessionEvent {session_id, event_seq, entry, activated,
     * deactivated}. `tree: true` watches the whole tree rooted at sessionId; `afterEventSeq`
     * resumes after the last event_seq seen. The server never ends the stream: leave the loop
     * (break/return) or abort `signal` to cancel it; both end the iteration without an error.
     * Any other failure is thrown from the loop as the grpc-js ServiceError.
     */
    async *watch(sessionId, { tree = false, afterSeq = 0, afterEventSeq = 0, signal } = {}, opts = {}) {
      const request = {
        session_id: sessionId,
        tree,
        after_seq: String(afterSeq),
        after_event_seq: String(afterEventSeq),
      };
      const stream = control.WatchSession(request, metadataFor(opts));
      let cancelled = false;
      const cancel = () => {
        cancelled = true;
        stream.cancel();
      };
      // grpc-js emits 'error' itself; keep a listener so a late one never goes unhandled.
      stream.on('error', () => {});
      if (signal) {
        if (signal.aborted) cancel();
        else signal.addEventListener('abort', cancel, { once: true });
      }
      try {
        for await (const event of stream) yield event;
      } catch (err) {
        if (!(cancelled && err && err.code === grpc.status.CANCELLED)) throw err;
      } finally {
        if (signal) signal.removeEventListener('abort', cancel);
        cancelled = true;
        stream.cancel();
      }
    },

    /** The raw AgentMesh.SendMessage (what a node sends for an agent; for tests and tools).
     * `request` is the wire SendMessageRequest {sender: {session_id, activation_id}, agent_id,
     * message, idempotency_key}. Resolves {delivery, accepted_seq, target_activation_id,
     * duplicate}. */
    sendMessage(request, opts) {
      return call(mesh, 'SendMessage', request, opts);
    },

    /** Closes the channel; calls in flight are cancelled. */
    close() {
      control.close();
    },
  };
}

module.exports = {
  connect,
  decodeError,
  load,
  status: grpc.status,
  MESH_DOMAIN,
  TOKEN_HEADER,
  NODE_HEADER,
  STATUS_DETAILS_HEADER,
};
