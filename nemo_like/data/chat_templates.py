"""Jinja2 chat templates for locally built tokenizers."""

from __future__ import annotations

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
