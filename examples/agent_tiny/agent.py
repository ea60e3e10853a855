"""The two-turn tiny episode (examples.agent_tiny.env:TwoTurns) written as agent programs
(gspo_mcore.envs.agent:AgentEnv): the same token sequence, driven by code that calls the policy like a chat API.

``two_turns`` calls it in-process (``client.chat``); ``two_turns_http`` speaks HTTP to the OpenAI-compatible
endpoint (``serve: true``) with the standard library, as a black-box program would:

    rollout:
      env: gspo_mcore.envs:AgentEnv
      env_kwargs: {agent: examples.agent_tiny.agent:two_turns_http, agent_kwargs: {hint: " ok "}, serve: true}
"""

import json
import urllib.request


def two_turns(client, row, hint: str = "\n", bonus: float = 0.0) -> float:
    """The prompt, a policy turn, ``hint`` as the next user message, a second turn; ``bonus`` when the first
    turn was not empty. The run's ``reward:`` scores the second turn."""
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat(messages)
    client.chat([*messages, first, {"role": "user", "content": hint}])
    return bonus if first["content"].strip() else 0.0


def two_turns_http(client, row, hint: str = "\n", bonus: float = 0.0) -> float:
    """``two_turns`` over HTTP: ``client.base_url`` and ``client.api_key`` are all a program needs."""

    def chat(messages):
        req = urllib.request.Request(
            client.base_url + "/chat/completions",
            data=json.dumps({"model": client.model, "messages": messages}).encode(),
            headers={"Authorization": f"Bearer {client.api_key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())["choices"][0]["message"]

    messages = [{"role": "user", "content": row["prompt"]}]
    first = chat(messages)
    chat([*messages, first, {"role": "user", "content": hint}])
    return bonus if first["content"].strip() else 0.0
