// The official openai Node SDK against a running Sluice edge.
//
// Usage: SLUICE_BASE_URL=http://127.0.0.1:8080/v1 SLUICE_MODEL=... node conformance.mjs
// Prints one JSON object of observations on stdout; tests/e2e/test_other_clients.py
// makes the assertions, so this script only records what the SDK returned.
import OpenAI from "openai";

const model = process.env.SLUICE_MODEL;
const client = new OpenAI({
  baseURL: process.env.SLUICE_BASE_URL,
  apiKey: process.env.SLUICE_API_KEY ?? "unused",
  maxRetries: 0,
  timeout: 120_000,
});
const messages = [{ role: "user", content: "What is the capital of France? Answer in one sentence." }];
const settings = { model, messages, temperature: 0, max_tokens: 6 };

async function errorOf(promise) {
  try {
    await promise;
    return null;
  } catch (error) {
    return { class: error.constructor.name, status: error.status ?? null, param: error.param ?? null };
  }
}

const out = {};

const whole = await client.chat.completions.create(settings);
out.chat = {
  id: whole.id,
  object: whole.object,
  content: whole.choices[0].message.content,
  finish_reason: whole.choices[0].finish_reason,
  usage: whole.usage,
};

const stream = await client.chat.completions.create({
  ...settings,
  stream: true,
  stream_options: { include_usage: true },
});
const streamed = { content: "", roles: 0, finishes: [], usage: null, objects: new Set() };
for await (const chunk of stream) {
  streamed.objects.add(chunk.object);
  for (const choice of chunk.choices) {
    if (choice.delta.role) streamed.roles += 1;
    streamed.content += choice.delta.content ?? "";
    if (choice.finish_reason) streamed.finishes.push(choice.finish_reason);
  }
  if (chunk.usage) streamed.usage = chunk.usage;
}
out.chat_stream = { ...streamed, objects: [...streamed.objects] };

const runner = client.chat.completions.stream(settings);
let deltas = "";
runner.on("content", (delta) => {
  deltas += delta;
});
const final = await runner.finalChatCompletion();
out.stream_helper = { deltas, final_content: final.choices[0].message.content };

const text = await client.completions.create({ model, prompt: "The capital of France is", max_tokens: 5, temperature: 0 });
out.completion = { object: text.object, text: text.choices[0].text, usage: text.usage };
const textStream = await client.completions.create({
  model,
  prompt: "The capital of France is",
  max_tokens: 5,
  temperature: 0,
  stream: true,
});
let streamedText = "";
for await (const chunk of textStream) streamedText += chunk.choices[0]?.text ?? "";
out.completion_stream = { text: streamedText };

out.errors = {
  bad_temperature: await errorOf(client.chat.completions.create({ ...settings, temperature: 7 })),
  unknown_model: await errorOf(client.chat.completions.create({ ...settings, model: "no-such-model" })),
  suffix: await errorOf(client.completions.create({ model, prompt: "x", suffix: "y" })),
};

console.log(JSON.stringify(out));
