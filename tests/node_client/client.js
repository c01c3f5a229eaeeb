// A pagedserve client in JavaScript, built only from protos/ (as an outside user would build
// one): @grpc/proto-loader reads the .proto files at run time, @grpc/grpc-js makes the calls.
//
//   node client.js <router host:port> <protos dir> <prompt> <base64 GenerateRequest>
//
// Makes, in order: ModelInfo; Tokenize of the prompt; a greedy Generate of it (temperature 0,
// max_tokens 16) read to the end of its stream; a Generate with temperature -1, which must fail.
// It also encodes that greedy request and decodes the given GenerateRequest (serialized by the
// Python stubs) with proto-loader's own codec, to show how proto3 `optional` fields travel.
// Prints one JSON object to stdout; a call that fails unexpectedly is reported in it, not thrown.

'use strict';

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const [address, protoRoot, prompt, pythonRequestBase64] = process.argv.slice(2);
if (!pythonRequestBase64) {
  console.error('usage: node client.js <host:port> <protos dir> <prompt> <base64 GenerateRequest>');
  process.exit(2);
}

// The options gRPC's own Node examples use. protobufjs ships google/protobuf/struct.proto, so
// only protos/ needs to be on the include path.
const packageDefinition = protoLoader.loadSync('pagedserve/v1/generation.proto', {
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [protoRoot],
});
const pagedserve = grpc.loadPackageDefinition(packageDefinition).pagedserve.v1;
const stub = new pagedserve.Generation(address, grpc.credentials.createInsecure());
const DEADLINE_MS = 60000;

function deadline() {
  return new Date(Date.now() + DEADLINE_MS);
}

function statusOf(error) {
  return {
    code: error.code,
    code_name: grpc.status[error.code],
    details: error.details,
    trailers: error.metadata ? error.metadata.getMap() : {},
  };
}

function unary(method, request) {
  return new Promise((resolve) => {
    stub[method](request, { deadline: deadline() }, (error, response) => {
      resolve(error ? { error: statusOf(error) } : { response });
    });
  });
}

function generate(request) {
  return new Promise((resolve) => {
    const result = { text: '', token_ids: [], finish_reason: null, request_ids: [], responses: 0,
      first_usage: null, last_usage: null };
    const call = stub.Generate(request, { deadline: deadline() });
    call.on('data', (response) => {
      result.responses += 1;
      result.request_ids.push(response.request_id);
      if (response.usage) {
        if (result.first_usage === null) result.first_usage = response.usage;
        result.last_usage = response.usage;
      }
      for (const choice of response.choices) {
        result.text += choice.text;
        result.token_ids.push(...choice.token_ids);
        if (choice.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
          result.finish_reason = choice.finish_reason;
        }
      }
    });
    call.on('error', (error) => resolve({ ...result, error: statusOf(error) }));
    call.on('status', (status) => {
      if (status.code === grpc.status.OK) resolve(result);
    });
  });
}

async function main() {
  const greedy = {
    text: prompt,
    request_id: 'node-greedy',
    params: { temperature: 0, max_tokens: 16 },
  };
  const methods = packageDefinition['pagedserve.v1.Generation'];
  const output = {
    model_info: await unary('ModelInfo', {}),
    tokenize: await unary('Tokenize', { text: prompt }),
    generate: await generate(greedy),
    invalid: await generate({ text: prompt, params: { temperature: -1, max_tokens: 16 } }),
    // The greedy request as proto-loader puts it on the wire, for the Python side to parse.
    greedy_request_base64: methods.Generate.requestSerialize(greedy).toString('base64'),
    // A request the Python stubs serialized, as proto-loader hands it to JavaScript.
    python_request: methods.Generate.requestDeserialize(Buffer.from(pythonRequestBase64, 'base64')),
  };
  stub.close();
  process.stdout.write(JSON.stringify(output) + '\n');
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
