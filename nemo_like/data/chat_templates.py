"""Jinja2 chat templates: the ones built in, and ``policy.chat_template`` (a template given in the config,
a file holding one, or none at all: raw text) resolved and put on a tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ChatML, as used by Qwen, but with no default system prompt injected: what the caller passes is exactly
# what is rendered, so a message log's rendered pieces concatenate to the full conversation.
# Roles are rendered verbatim, so system/user/assistant/tool/environment all work; a message whose role
# or content is missing fails loudly instead of rendering "None".
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] is not defined or message['content'] is not defined -%}"
    "{{- raise_exception('every chat message needs a role and a content') -}}"
    "{%- endif -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool', 'environment'] -%}"
    "{{- raise_exception('unsupported chat role: ' ~ message['role']"
    " ~ ' (expected system, user, assistant, tool or environment)') -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# No template: the messages' contents back to back, nothing added (no role markers, no generation
# prompt), so a prompt reaches the model as the exact text the dataset's prompt format made of it.
RAW_TEMPLATE = "{%- for message in messages -%}{{- message['content'] -}}{%- endfor -%}"

# The values of policy.chat_template that are names rather than templates.
DEFAULT = "default"  # the tokenizer's own template
RAW_NAMES = ("raw", "none")  # no template (YAML null means the same, as in NeMo RL)
NAMED_TEMPLATES = {"chatml": CHATML_TEMPLATE}


def resolve_chat_template(setting: str | None, *, key: str = "policy.chat_template") -> str | None:
    """The jinja text ``setting`` stands for, or None for ``"default"`` (keep the tokenizer's own).

    ``setting`` is ``"default"``; ``"raw"``/``"none"``/None (no template: :data:`RAW_TEMPLATE`); a
    name of :data:`NAMED_TEMPLATES` (``"chatml"``); a jinja template (text with ``{%`` or ``{{``); or the
    path of a file holding one. ValueError naming ``key`` (and the file and line of a syntax error).
    """
    if setting is None or setting.strip().lower() in RAW_NAMES:
        return RAW_TEMPLATE
    if setting == DEFAULT:
        return None
    if setting in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[setting]
    if "{%" in setting or "{{" in setting:
        _check_syntax(setting, f"{key}: the template")
        return setting
    path = Path(setting).expanduser()
    if not path.is_file():
        raise ValueError(
            f"{key}={setting!r}: not a jinja template (no '{{%' or '{{{{' in it) nor a file "
            f"({'a folder' if path.exists() else 'no such file'}); set it to a template, the path of a "
            f".jinja file, {DEFAULT!r} (the tokenizer's own), 'chatml', or 'raw' (no template: prompts as plain text)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{key}: {path}: cannot read it as text ({e})") from None
    if "{%" not in text and "{{" not in text:
        raise ValueError(f"{key}: {path} holds no jinja markup ('{{%' or '{{{{'): not a chat template")
    _check_syntax(text, f"{key}: {path}")
    return text


def _check_syntax(text: str, where: str) -> None:
    # The environment transformers renders templates in (loop controls such as {% break %} allowed).
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        env.parse(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"{where}:{e.lineno}: jinja syntax error: {e.message}") from None


def apply_chat_template_setting(tokenizer: Any, setting: str | None, *, key: str = "policy.chat_template") -> Any:
    """Give ``tokenizer`` the template ``setting`` names (:func:`resolve_chat_template`) and return it;
    ValueError naming ``key`` when the setting is ``"default"`` and the tokenizer has no template."""
    template = resolve_chat_template(setting, key=key)
    if template is not None:
        tokenizer.chat_template = template
    elif not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"{key}: the tokenizer of {name} has no chat template; set {key} to a jinja template (a string or "
            "the path of a .jinja file), 'chatml', or 'raw' for prompts as plain text without a template")
    return tokenizer
