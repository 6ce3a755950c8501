// The official openai Node SDK's Responses API against a running Sluice edge.
//
// Usage: SLUICE_BASE_URL=http://127.0.0.1:8080/v1 SLUICE_MODEL=... node responses.mjs
// Prints one JSON object of observations on stdout; tests/e2e/test_surfaces_sdks.py makes the
// assertions, so this script only records what the SDK returned.
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: process.env.SLUICE_BASE_URL,
  apiKey: "unused",
  maxRetries: 0,
  timeout: 120_000,
});
const settings = {
  model: process.env.SLUICE_MODEL,
  input: "What is the capital of France? Answer in one sentence.",
  temperature: 0,
  max_output_tokens: 16,
};
const out = {};

const whole = await client.responses.create(settings);
out.create = { text: whole.output_text, status: whole.status, usage: whole.usage, object: whole.object };

const stream = await client.responses.create({ ...settings, stream: true });
const types = [];
let text = "";
for await (const event of stream) {
  types.push(event.type);
  if (event.type === "response.output_text.delta") text += event.delta;
}
out.stream = { types, text };

const runner = client.responses.stream(settings);
let deltas = "";
runner.on("response.output_text.delta", (event) => {
  deltas += event.delta;
});
const final = await runner.finalResponse();
out.helper = { deltas, text: final.output_text, status: final.status, usage: final.usage };

try {
  await client.responses.create({ ...settings, previous_response_id: "resp_x" });
  out.stateful = null;
} catch (error) {
  out.stateful = { class: error.constructor.name, status: error.status ?? null, param: error.param ?? null };
}

process.stdout.write(JSON.stringify(out));
