"""Environments for the tiny agent runs (plain text: the tiny model's tokenizer has no chat template)."""

from gspo_mcore.envs import Reset, Step


class TwoTurns:
    """The prompt, a policy turn, then ``hint`` from the environment, a second policy turn, done. The run's
    ``reward:`` scores the second turn; ``bonus`` is added when the first turn was not empty."""

    def __init__(self, hint: str = "\n", bonus: float = 0.0):
        self.hint, self.bonus = hint, bonus

    def reset(self, row):
        return Reset(observation=row["prompt"], state={"turns": 0})

    def step(self, state, action):
        state["turns"] += 1
        if state["turns"] == 1:
            return Step(observation=self.hint, reward=self.bonus if action.strip() else 0.0, info={"tool_calls": 1})
        return Step(done=True)
