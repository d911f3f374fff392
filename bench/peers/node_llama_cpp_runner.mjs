// kvserve bench: run a request list through llama.cpp (node-llama-cpp's prebuilt CPU build).
//
//   node node_llama_cpp_runner.mjs SPEC.json OUT.json
//
// SPEC: {model, threads, parallel, contextSize, requests: [{tokens: [ids], maxTokens}]}
// Greedy (temperature 0), raw token ids in (no BOS added, no chat template: the caller sends
// exactly the ids kvserve gets), EOS yielded and ignored so every request produces exactly
// maxTokens tokens. `parallel` sequences of one context pull requests from a shared queue;
// node-llama-cpp batches the sequences' pending tokens into one llama_decode per cycle.
// OUT: {load_s, elapsed_s, requests: [{ttft_s, decode_s, tokens}], ...}; times from the
// first submission.
import { readFileSync, writeFileSync } from "node:fs";
import { getLlama, LlamaLogLevel } from "node-llama-cpp";

const [specPath, outPath] = process.argv.slice(2);
const spec = JSON.parse(readFileSync(specPath, "utf8"));
const now = () => performance.now() / 1000;

const t0 = now();
const llama = await getLlama({ gpu: false, build: "never", skipDownload: true, logLevel: LlamaLogLevel.error,
                               maxThreads: spec.threads });
const model = await llama.loadModel({ modelPath: spec.model, gpuLayers: 0 });
const context = await model.createContext({ contextSize: spec.contextSize, sequences: spec.parallel,
                                            threads: { ideal: spec.threads, min: spec.threads },
                                            batchSize: Math.max(512, spec.parallel) });
const loadS = now() - t0;

async function runOne(sequence, req) {
  await sequence.clearHistory();
  const sent = now();
  const tokens = [];
  let first = null;
  if (req.maxTokens > 0) {
    for await (const token of sequence.evaluate(req.tokens, { temperature: 0, yieldEogToken: true })) {
      if (first === null) first = now();
      tokens.push(token);
      if (tokens.length >= req.maxTokens) break;
    }
  }
  const end = now();
  return { sent, first: first ?? end, end, tokens };
}

// Warm-up (kernels, allocator): one short request on the first sequence, not timed.
const warmSeq = context.getSequence();
await runOne(warmSeq, { tokens: spec.requests[0].tokens.slice(0, 16), maxTokens: 2 });
const sequences = [warmSeq];
for (let i = 1; i < spec.parallel; i++) sequences.push(context.getSequence());

const results = new Array(spec.requests.length);
let next = 0;
const start = now();
await Promise.all(sequences.map(async (sequence) => {
  while (next < spec.requests.length) {
    const i = next++;
    results[i] = await runOne(sequence, spec.requests[i]);
  }
}));
const elapsed = now() - start;

writeFileSync(outPath, JSON.stringify({
  load_s: loadS,
  elapsed_s: elapsed,
  parallel: spec.parallel,
  threads: context.currentThreads ?? spec.threads,
  context_size: context.contextSize,
  gpu: llama.gpu,
  llama_cpp_release: llama.llamaCppRelease?.release ?? null,
  requests: results.map((r) => ({ send_s: r.sent - start, ttft_s: r.first - r.sent, decode_s: r.end - r.first,
                                  tokens: r.tokens })),
}));
await context.dispose();
await model.dispose();
await llama.dispose();
