"""A black-box agent for tests/envs/test_agent_env.py: a separate process that knows only the endpoint
(OPENAI_BASE_URL, OPENAI_API_KEY) and speaks HTTP with the standard library. It looks a key up and answers;
it prints its reward (1 when it looked the key up and the final answer is the row's "expect")."""

import json
import os
import sys
import urllib.request

TOOLS = json.loads(sys.argv[2])


def chat(messages):
    req = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": messages, "tools": TOOLS}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        body = json.loads(r.read())
    return body["choices"][0]["message"]


row = json.loads(sys.argv[1])
messages = [{"role": "user", "content": row["prompt"]}]
reply = chat(messages)
if not reply.get("tool_calls"):  # no call: the reply is the final answer
    print(0.0)
    sys.exit(0)
messages.append(reply)
for c in reply["tool_calls"]:
    value = row["metadata"]["table"][json.loads(c["function"]["arguments"])["key"]]
    messages.append({"role": "tool", "name": c["function"]["name"], "content": value})
final = chat(messages)
print(1.0 if final["content"] == row["metadata"]["expect"] else 0.0)
