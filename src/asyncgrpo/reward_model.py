"""A reward model as a reward function: a sequence-classification checkpoint directory in `reward_funcs`, as TRL takes.

`RewardModel(path)` scores each completion, prompt first, with the model's first logit, the completions of one group
in batches of `batch_size`. It loads on its first call, in the process that scores (a reward worker, or the rollout
side's process with `reward_workers: 0`), so that a pool's parent holds no copy it never uses.
"""

from __future__ import annotations

import threading


class RewardModel:
    """`fn(prompts, completions, **columns)` backed by `AutoModelForSequenceClassification`; the score of a
    completion is logit 0 of prompt + completion (a chat prompt and completion through the reward model's chat
    template when it has one)."""

    def __init__(self, path: str, batch_size: int = 16):
        if batch_size < 1:
            raise TypeError(f"batch_size must be 1 or more, got {batch_size}")
        self.path, self.batch_size = path, batch_size
        self.__name__ = path  # what error messages call a reward function
        self._model = self._tokenizer = None
        self._lock = threading.Lock()  # request threads score at once; a fast tokenizer must not be shared by them

    def _load(self) -> None:
        # heavy: torch and transformers, only where a reward model scores
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
        model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype="auto")
        model.config.pad_token_id = tokenizer.pad_token_id  # the model reads the last non-pad token
        self._device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self._model, self._tokenizer = model.to(self._device).eval(), tokenizer

    def text(self, prompt, completion) -> str:
        """What the model reads: plain text joined, or chat messages through the tokenizer's chat template (their
        contents joined when it has none)."""
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt + completion
        messages = (prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]) + (
            completion if isinstance(completion, list) else [{"role": "assistant", "content": str(completion)}])
        if getattr(self._tokenizer, "chat_template", None):
            return self._tokenizer.apply_chat_template(messages, tokenize=False)
        return "".join(str(m.get("content") or "") for m in messages)

    def __call__(self, prompts, completions, **columns) -> list[float]:
        import torch  # heavy: see _load

        with self._lock:
            if self._model is None:
                self._load()
            texts = [self.text(p, c) for p, c in zip(prompts, completions)]
            scores: list[float] = []
            for i in range(0, len(texts), self.batch_size):
                batch = self._tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                                        add_special_tokens=False).to(self._device)
                with torch.no_grad():
                    logits = self._model(**batch).logits  # (B, num_labels)
                scores.extend(float(x) for x in logits[:, 0].float().cpu())
            return scores
