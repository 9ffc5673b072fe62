"""Turn dataset rows into DatumSpecs: chat-template rendering, tokenization, truncation, task routing.

Each message's ``content`` is the *rendered* chat-template text of that message (NeMo RL convention) and
its ``token_ids`` the tokens of that text, so concatenating the message log reproduces the model input.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset

from nemo_like.data.interfaces import DatumSpec, LLMMessageLogType, TaskDataSpec
from nemo_like.data.messages import clean_conversation, is_conversation
from nemo_like.utils.registry import Registry, import_from_path


class DataProcessor(Protocol):
    def __call__(
        self,
        datum: dict[str, Any],
        task_data_spec: TaskDataSpec,
        tokenizer: Any,
        max_seq_length: int,
        idx: int,
    ) -> DatumSpec: ...


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict] | None = None) -> str:
    """``messages`` rendered by the tokenizer's chat template as text (``tools``: the tool schemas a
    tool-calling template shows). ValueError naming the fix when the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat template; set policy.chat_template to a jinja "
            "template (a string or a .jinja file), 'chatml', or 'raw' for prompts as plain text "
            "(in code: tokenizer.chat_template = nemo_like.data.chat_templates.CHATML_TEMPLATE)"
        )
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if tools:
        kwargs["tools"] = tools
    text = tokenizer.apply_chat_template(messages, **kwargs)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def tokenize_text(tokenizer: Any, text: str) -> torch.Tensor:
    """The token ids [L] of already rendered text (no special tokens added: the template put them)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def _field(datum: Mapping[str, Any], key: str, idx: int) -> Any:
    if key not in datum:
        raise KeyError(f"row {idx} has no '{key}' column (columns: {sorted(datum)})")
    return datum[key]


def prompt_chat(datum: Mapping[str, Any], spec: TaskDataSpec, idx: int) -> list[dict[str, Any]]:
    """The prompt's messages: the system prompt, the worked examples (``few_shot``) as earlier turns, then
    the user turn ``spec.prompt.format(problem)`` (or the row's ``problem``). KeyError naming the row.

    A ``problem`` that is a list of messages (a conversational prompt) is the conversation as written:
    ``spec.system_prompt`` goes first only when the conversation has no system message of its own (the
    row's wins), and ``spec.prompt`` / ``spec.few_shot`` must be unset (ValueError: nothing to format).
    """
    problem = _field(datum, "problem", idx)
    if is_conversation(problem):
        return _conversation_chat(problem, spec, idx)
    problem = str(problem)
    chat: list[dict[str, Any]] = []
    if spec.system_prompt:
        chat.append({"role": "system", "content": spec.system_prompt})
    for shot in spec.few_shot or ():
        chat.append({"role": "user", "content": spec.prompt.format(shot["problem"]) if spec.prompt else shot["problem"]})
        chat.append({"role": "assistant", "content": shot["response"]})
    chat.append({"role": "user", "content": spec.prompt.format(problem) if spec.prompt else problem})
    return chat


def _conversation_chat(messages: Any, spec: TaskDataSpec, idx: int) -> list[dict[str, Any]]:
    try:
        chat = clean_conversation(messages)
    except ValueError as e:
        raise ValueError(f"row {idx}: the prompt conversation is malformed: {e}") from None
    for what, value in (("prompt", spec.prompt), ("few_shot", spec.few_shot)):
        if value:
            raise ValueError(f"row {idx}: a conversational prompt is rendered as written, so task "
                             f"{spec.task_name!r} cannot also have a {what} ({value!r}); set {what} to null")
    if spec.system_prompt and chat[0]["role"] != "system":
        chat.insert(0, {"role": "system", "content": spec.system_prompt})
    return chat


def _prompt_message_log(tokenizer: Any, chat: list[dict[str, str]]) -> tuple[LLMMessageLogType, str]:
    """Message log of the prompt (ending in the generation prompt) and its full rendered text.

    The conversation is rendered once as a whole and then cut at message boundaries (rather than rendering
    each message alone) so templates that inject a default system prompt when none is given (Qwen) still
    produce exactly what ``apply_chat_template(chat, add_generation_prompt=True)`` gives.
    """
    full = render_chat(tokenizer, chat, add_generation_prompt=True)
    pieces: list[tuple[str, str]] = []
    if chat[0]["role"] == "system":
        prefix = render_chat(tokenizer, chat[:1], add_generation_prompt=False)
        if prefix and full.startswith(prefix):
            pieces = [("system", prefix), ("user", full[len(prefix) :])]
    if not pieces:  # no system prompt, or a template whose pieces do not concatenate: one user message
        pieces = [("user", full)]
    log = [{"role": role, "content": text, "token_ids": tokenize_text(tokenizer, text)} for role, text in pieces]
    return log, full


def truncate_message_log(message_log: LLMMessageLogType, max_seq_length: int) -> tuple[int, float]:
    """Cut the log to its first ``max_seq_length`` tokens in place; returns (length, loss_multiplier).

    A sample that had to be cut carries no loss: its prompt (or target) is incomplete, so training on it
    would teach the model from a corrupted context. ``content`` is left as rendered (BPE token cuts need not
    fall on character boundaries); ``token_ids`` is what the model sees.
    """
    if max_seq_length <= 0:
        raise ValueError(f"max_seq_length must be positive, got {max_seq_length}")
    total = sum(int(m["token_ids"].numel()) for m in message_log)
    if total <= max_seq_length:
        return total, 1.0
    budget = max_seq_length
    for message in message_log:
        keep = min(budget, int(message["token_ids"].numel()))
        message["token_ids"] = message["token_ids"][:keep]
        budget -= keep
    return max_seq_length, 0.0


def _hidden_columns(datum: Mapping[str, Any], idx: int) -> dict[str, Any]:
    """What the environment (and reward functions) see of a row: its columns, never shown to the
    model, with the answer under ``ground_truth``. Lists and mappings (test cases, allowed answers)
    reach it too."""
    extra = {k: v for k, v in datum.items() if isinstance(v, (str, int, float, bool, list, tuple, dict)) or v is None}
    extra["ground_truth"] = str(_field(datum, "expected_answer", idx))
    return extra


def make_datum_spec(message_log: LLMMessageLogType, *, max_seq_length: int, extra_env_info: dict[str, Any] | None,
                    idx: int, task_name: str | None, stop_strings: list[str] | None = None) -> DatumSpec:
    """The ``DatumSpec`` a processor returns: the log cut to ``max_seq_length`` tokens (a sample that had
    to be cut carries no loss, ``loss_multiplier`` 0), its length, and what the environment is told
    (``extra_env_info``, never shown to the model)."""
    length, loss_multiplier = truncate_message_log(message_log, max_seq_length)
    return DatumSpec(message_log=message_log, length=length, extra_env_info=extra_env_info,
                     loss_multiplier=loss_multiplier, idx=idx, task_name=task_name, stop_strings=stop_strings)


def math_data_processor(
    datum: dict[str, Any],
    task_data_spec: TaskDataSpec,
    tokenizer: Any,
    max_seq_length: int,
    idx: int,
) -> DatumSpec:
    """A math row (``problem``, ``expected_answer``) → prompt-only DatumSpec for RL.

    The prompt is the optional system prompt plus the user turn ``task_data_spec.prompt.format(problem)``
    (or the raw problem), ending in the assistant generation prompt. The answer goes to the environment
    only, as ``extra_env_info["ground_truth"]``.
    """
    chat = prompt_chat(datum, task_data_spec, idx)
    message_log, _ = _prompt_message_log(tokenizer, chat)
    return make_datum_spec(message_log, max_seq_length=max_seq_length, extra_env_info=_hidden_columns(datum, idx),
                           idx=idx, task_name=task_data_spec.task_name)


def sft_data_processor(
    datum: dict[str, Any],
    task_data_spec: TaskDataSpec,
    tokenizer: Any,
    max_seq_length: int,
    idx: int,
    *,
    response_fn: Callable[[dict[str, Any]], str] | None = None,
    response_key: str = "response",
) -> DatumSpec:
    """Like :func:`math_data_processor` plus the target assistant turn, for supervised fine-tuning.

    The response is ``response_fn(datum)`` if given (bind it with ``functools.partial``), else the row's
    ``response_key`` column. The assistant message holds the rendered assistant-turn tail (with ChatML:
    ``{response}<|im_end|>\\n``) so an SFT loss can train on exactly the assistant tokens, end-of-turn
    token included (the model must learn to stop).
    """
    chat = prompt_chat(datum, task_data_spec, idx)
    message_log, prompt_text = _prompt_message_log(tokenizer, chat)
    response = response_fn(datum) if response_fn is not None else _field(datum, response_key, idx)
    if not isinstance(response, str):
        raise TypeError(f"row {idx}: the response must be a string, got {type(response).__name__}")
    full = render_chat(tokenizer, chat + [{"role": "assistant", "content": response}], add_generation_prompt=False)
    if not full.startswith(prompt_text):
        raise ValueError(
            "the chat template does not render a conversation as its prompt (with generation prompt) followed "
            "by the assistant turn, so assistant tokens cannot be separated for the SFT loss"
        )
    tail = full[len(prompt_text) :]
    message_log.append({"role": "assistant", "content": tail, "token_ids": tokenize_text(tokenizer, tail)})
    extra = {"ground_truth": str(datum["expected_answer"])} if "expected_answer" in datum else {}
    return make_datum_spec(message_log, max_seq_length=max_seq_length, extra_env_info=extra, idx=idx,
                           task_name=task_data_spec.task_name)


class AllTaskProcessedDataset(Dataset):
    """A map-style dataset that turns row ``i`` into a DatumSpec with its task's processor.

    ``task_data_processors`` is either one processor used for every row (with ``default_task_data_spec``),
    or ``{task_name: (TaskDataSpec, processor)}``; rows are routed by their ``task_name`` column (rows
    without one use ``default_task_data_spec.task_name``).
    """

    def __init__(
        self,
        dataset: Any,
        tokenizer: Any,
        default_task_data_spec: TaskDataSpec,
        task_data_processors: DataProcessor | dict[str, tuple[TaskDataSpec, DataProcessor]],
        max_seq_length: int,
    ) -> None:
        if not isinstance(max_seq_length, int) or max_seq_length <= 0:
            raise ValueError(f"max_seq_length must be a positive int, got {max_seq_length!r}")
        if isinstance(task_data_processors, dict):
            for name, entry in task_data_processors.items():
                if not (
                    isinstance(entry, tuple)
                    and len(entry) == 2
                    and isinstance(entry[0], TaskDataSpec)
                    and callable(entry[1])
                ):
                    raise TypeError(
                        f"task_data_processors['{name}'] must be a (TaskDataSpec, processor) tuple, got {entry!r}"
                    )
        elif not callable(task_data_processors):
            raise TypeError(
                "task_data_processors must be a processor or a dict {task_name: (TaskDataSpec, processor)}, "
                f"got {type(task_data_processors).__name__}"
            )
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.default_task_data_spec = default_task_data_spec
        self.task_data_processors = task_data_processors
        self.max_seq_length = max_seq_length

    def __len__(self) -> int:
        return len(self.dataset)

    def _route(self, task_name: str) -> tuple[TaskDataSpec, DataProcessor]:
        if not isinstance(self.task_data_processors, dict):
            return self.default_task_data_spec, self.task_data_processors
        if task_name not in self.task_data_processors:
            raise KeyError(
                f"no data processor for task '{task_name}'; known tasks: {sorted(self.task_data_processors)}"
            )
        return self.task_data_processors[task_name]

    def __getitem__(self, i: int) -> DatumSpec:
        i = operator.index(i)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for a dataset of {n} rows")
        i %= n
        row = dict(self.dataset[i])
        spec, processor = self._route(row.get("task_name") or self.default_task_data_spec.task_name)
        return processor(row, spec, self.tokenizer, self.max_seq_length, i)


# ---- processor registry ------------------------------------------------------------------------
def _boxed_response(datum: dict[str, Any]) -> str:
    return f"\\boxed{{{datum['expected_answer']}}}"


def _math_sft(datum, spec, tokenizer, max_seq_length, idx):
    return sft_data_processor(datum, spec, tokenizer, max_seq_length, idx, response_fn=_boxed_response)


def _code_sft(datum, spec, tokenizer, max_seq_length, idx):
    return sft_data_processor(datum, spec, tokenizer, max_seq_length, idx,
                              response_fn=lambda d: str(d["reference_solution"]))


ProcessorPair = tuple[DataProcessor | str, DataProcessor | str | None]


def _check_pair(name: str, pair: Any) -> None:
    if not (isinstance(pair, tuple) and len(pair) == 2):
        raise TypeError(f"data processor {name!r}: expected a (processor, sft_processor) pair, got {pair!r}")
    for role, entry in zip(("processor", "sft_processor"), pair, strict=True):
        if role == "sft_processor" and entry is None:
            continue
        if not (callable(entry) or (isinstance(entry, str) and entry)):
            raise TypeError(f"data processor {name!r}: {role} must be a callable or an import path "
                            f"'pkg.module.name', got {entry!r}")


# name -> (RL processor, SFT processor). Either member may be an import path, imported on first use
# so that registering the built-ins imports nothing; the pair is one entry so that replacing a
# processor never leaves the previous one's SFT variant behind.
PROCESSOR_REGISTRY: Registry[ProcessorPair] = Registry("data processor", check=_check_pair, builtins={
    "math": (math_data_processor, _math_sft),
    # reasoning-gym rows are prompt-only like math rows; their extra columns reach the environment.
    "reasoning_gym": (math_data_processor, _math_sft),
    "code": ("nemo_like.data.code_tasks.code_data_processor", _code_sft),
    "tool": ("nemo_like.data.tool_tasks.tool_data_processor", "nemo_like.data.tool_tasks.tool_sft_data_processor"),
})


def register_processor(name: str, processor: DataProcessor | str, sft_processor: DataProcessor | str | None = None,
                       *, overwrite: bool = False) -> None:
    """Make `processor` (row -> DatumSpec for RL) and optionally `sft_processor` (row -> DatumSpec
    ending with the target assistant turn) available as `data.<split>.processor: name`. The same pair
    again is a no-op; a different one needs `overwrite=True`."""
    PROCESSOR_REGISTRY.register(name, (processor, sft_processor), overwrite=overwrite)


def _resolve(name: str, entry: DataProcessor | str) -> DataProcessor:
    if not isinstance(entry, str):
        return entry
    obj = import_from_path(entry, what=f"data processor {name!r}")
    if not callable(obj):
        raise TypeError(f"data processor {name!r}: {entry!r} is a {type(obj).__name__}, not a callable")
    return obj


def get_processor(name: str, *, sft: bool = False) -> DataProcessor:
    try:
        rl, sft_proc = PROCESSOR_REGISTRY.get(name)
    except KeyError as e:
        raise KeyError(f"{e.args[0]} (add one with nemo_like.data.processors.register_processor)") from None
    if sft:
        if sft_proc is None:
            raise KeyError(f"data processor {name!r} has no SFT variant, so it cannot bootstrap a model")
        return _resolve(name, sft_proc)
    return _resolve(name, rl)


class ConcatTaskDataset(Dataset):
    """Several task datasets behind one index: a multi-task run samples across all of them."""

    def __init__(self, parts: list[Any]) -> None:
        if not parts:
            raise ValueError("ConcatTaskDataset needs at least one dataset")
        self.parts = list(parts)
        self.offsets = [0]
        for p in self.parts:
            self.offsets.append(self.offsets[-1] + len(p))

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, i: int) -> DatumSpec:
        i = operator.index(i)
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for a dataset of {len(self)} rows")
        k = next(k for k in range(len(self.parts)) if i < self.offsets[k + 1])
        return self.parts[k][i - self.offsets[k]]

    def first_indices(self, per_part: int) -> list[int]:
        """The first `per_part` rows of every part (validation covers every task)."""
        return [self.offsets[k] + j for k, p in enumerate(self.parts) for j in range(min(per_part, len(p)))]
