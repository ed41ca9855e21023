"""OpenAI's official client against a kvdb server: its models, completions and chat
completions, plain and streamed, parse into the client's types and agree with each other.
Usage: python openai_client.py BASE_URL CORPUS QUESTION EXPECTED_ANSWER"""

import sys

import openai

base, corpus, question, expected = sys.argv[1:5]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused")

ids = [m.id for m in client.models.list().data]
assert corpus in ids and f"{corpus}:flat" in ids, ids

c = client.completions.create(model=corpus, prompt=question, max_tokens=6)
assert c.object == "text_completion", c
assert len(c.choices) == 1 and c.choices[0].finish_reason in ("stop", "length"), c
assert c.choices[0].text == expected, (c.choices[0].text, expected)
assert c.usage.completion_tokens > 0 and c.usage.total_tokens >= c.usage.completion_tokens, c

pieces = [chunk.choices[0].text for chunk in
          client.completions.create(model=corpus, prompt=question, max_tokens=6, stream=True)]
assert len(pieces) >= 3 and "".join(pieces) == expected, pieces

chat = client.chat.completions.create(
    model=f"{corpus}:flat", messages=[{"role": "user", "content": question}], max_tokens=6)
assert chat.object == "chat.completion", chat
message = chat.choices[0].message
assert message.role == "assistant" and message.content == expected, message
assert chat.choices[0].finish_reason in ("stop", "length"), chat

deltas = []
finish = None
for chunk in client.chat.completions.create(
        model=corpus, messages=[{"role": "user", "content": question}], max_tokens=6, stream=True):
    assert chunk.object == "chat.completion.chunk", chunk
    deltas.append(chunk.choices[0].delta.content or "")
    finish = chunk.choices[0].finish_reason or finish
assert "".join(deltas) == expected and finish in ("stop", "length"), (deltas, finish)

try:
    client.completions.create(model="no-such-corpus", prompt=question, max_tokens=2)
    raise AssertionError("an unknown corpus should fail")
except openai.NotFoundError as e:
    assert e.status_code == 404, e

print("openai client: OK")
