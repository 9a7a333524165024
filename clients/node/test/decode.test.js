'use strict';
// decodeError on hand-built trailers: no cluster needed.

const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');

const grpc = require('@grpc/grpc-js');
const protobuf = require('protobufjs');

const { decodeError, load, STATUS_DETAILS_HEADER } = require('../lib/mesh');

const root = new protobuf.Root();
root.resolvePath = (_origin, target) =>
  path.isAbsolute(target) ? target : path.join(__dirname, '..', 'proto', target);
root.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto'], { keepCase: true });
const Status = root.lookupType('google.rpc.Status');
const ErrorInfo = root.lookupType('google.rpc.ErrorInfo');
const RetryInfo = root.lookupType('google.rpc.RetryInfo');
const { Rejection } = load();

function any(type, name, value) {
  return { type_url: `type.googleapis.com/${name}`, value: type.encode(type.fromObject(value)).finish() };
}

/** A ServiceError as grpc-js builds it, with a google.rpc.Status of `details` in its trailer. */
function serviceError(code, message, details) {
  const metadata = new grpc.Metadata();
  if (details) {
    const bin = Status.encode(Status.fromObject({ code, message, details })).finish();
    metadata.set(STATUS_DETAILS_HEADER, Buffer.from(bin));
  }
  return Object.assign(new Error(`${code} ${message}`), { code, details: message, metadata });
}

test('a retryable mesh refusal: reason, domain, metadata, typed rejection and retry delay', () => {
  const err = serviceError(grpc.status.UNAVAILABLE, 'PARENT_NOT_LIVE: s-1 has no live activation', [
    any(ErrorInfo, 'google.rpc.ErrorInfo', {
      reason: 'PARENT_NOT_LIVE',
      domain: 'dsh.mesh.v1',
      metadata: { target_session_id: 's-1' },
    }),
    any(Rejection, 'dsh.mesh.v1.Rejection', {
      reason: 'REJECTION_REASON_PARENT_NOT_LIVE',
      detail: 's-1 has no live activation',
      target_session_id: 's-1',
    }),
    any(RetryInfo, 'google.rpc.RetryInfo', { retry_delay: { seconds: 0, nanos: 200_000_000 } }),
  ]);
  const e = decodeError(err);
  assert.equal(e.code, 14);
  assert.equal(e.codeName, 'UNAVAILABLE');
  assert.equal(e.reason, 'PARENT_NOT_LIVE');
  assert.equal(e.domain, 'dsh.mesh.v1');
  assert.equal(e.mesh, true);
  assert.deepEqual(e.metadata, { target_session_id: 's-1' });
  assert.equal(e.message, 'PARENT_NOT_LIVE: s-1 has no live activation');
  assert.equal(e.rejection.reason, 'REJECTION_REASON_PARENT_NOT_LIVE');
  assert.equal(e.detail, 's-1 has no live activation');
  assert.equal(e.retryDelayMs, 200);
});

test("another domain's ErrorInfo is reported but is not the mesh's", () => {
  const err = serviceError(grpc.status.RESOURCE_EXHAUSTED, 'quota', [
    any(ErrorInfo, 'google.rpc.ErrorInfo', { reason: 'RATE_LIMITED', domain: 'proxy.example' }),
  ]);
  const e = decodeError(err);
  assert.equal(e.mesh, false);
  assert.equal(e.reason, 'RATE_LIMITED');
  assert.equal(e.domain, 'proxy.example');
  assert.equal(e.retryDelayMs, null);
});

test('a status without details (gRPC itself, a deadline) has only its code', () => {
  const e = decodeError(serviceError(grpc.status.DEADLINE_EXCEEDED, 'Deadline exceeded'));
  assert.deepEqual(
    { code: e.code, codeName: e.codeName, reason: e.reason, domain: e.domain, mesh: e.mesh },
    { code: 4, codeName: 'DEADLINE_EXCEEDED', reason: null, domain: null, mesh: false },
  );
  assert.equal(e.message, 'Deadline exceeded');
});

test('garbage in the trailer and non-gRPC errors never throw', () => {
  const err = serviceError(grpc.status.INTERNAL, 'boom');
  err.metadata.set(STATUS_DETAILS_HEADER, Buffer.from([0xff, 0xff, 0xff]));
  assert.equal(decodeError(err).reason, null);
  assert.equal(decodeError(new TypeError('not a call')).code, grpc.status.UNKNOWN);
  assert.equal(decodeError(undefined).code, grpc.status.UNKNOWN);
});
