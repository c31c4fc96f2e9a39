"""The OpenAI request fields this server reads, checked one by one: a bad one is a 400 that names it."""
from __future__ import annotations

import json
from dataclasses import dataclass

from .scheduler import Refused

MAX_STOPS = 4
# The deepest request body read: OpenAI's own requests go a few levels deep (messages[i].content[j].text), a JSON
# schema in response_format a few more; a body nested deeper is refused before anything walks it.
MAX_DEPTH = 64


@dataclass
class Params:
    """One request's generation parameters; prompt: chat messages, or a completion's text or token ids."""

    prompt: list[dict] | str | list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool


def nesting(value, most: int) -> int:
    """How many objects and lists deep `value` goes, counted without recursion; stops once past `most`."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= most:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest if isinstance(value, (dict, list)) else 0


def _too_deep() -> Refused:
    return Refused(400, f"the request body is nested more than {MAX_DEPTH} objects or lists deep", None,
                   "invalid_json")


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise Refused(400, f"the request body is not valid JSON ({err})", None, "invalid_json") from None
    except RecursionError:   # deeper than Python's stack: json gives up before MAX_DEPTH is checked
        raise _too_deep() from None
    if not isinstance(body, dict):
        raise Refused(400, "the request body must be a JSON object", None, "invalid_json")
    if nesting(body, MAX_DEPTH) > MAX_DEPTH:   # what parses may still be too deep to print in an error or to copy
        raise _too_deep()
    return body


def bad(param: str, message: str) -> Refused:
    return Refused(400, f"{param}: {message}", param, "invalid_value")


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, f"must be a number, got {json.dumps(value)}")
    if value > high or value < low or (low_open and value == low):
        raise bad(name, f"must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value}")
    return float(value)


def _integer(body: dict, name: str, low: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"must be an integer, got {json.dumps(value)}")
    if low is not None and value < low:
        raise bad(name, f"must be >= {low}, got {value}")
    return value


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise Refused(400, "messages: this field is required", "messages", "missing_field")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad(f"{where}.role", f"must be system, developer, user or assistant, got {json.dumps(role)}")
        if isinstance(content, list):   # content parts: only text ones
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"{where}.content[{j}]", "only text parts ({type: text, text}) are supported")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad(f"{where}.content", "must be a string or a list of text parts")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise Refused(400, "prompt: this field is required", "prompt", "missing_field")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise bad("prompt", "must be a string or a list of token ids (one prompt per request)")


def served_model_id(spec: str) -> str:
    """The model name a server answers to by default: a short name for the target `spec` (what clients type in
    "model"): an alias as it is, a `.gguf` file or a local folder by its name (`gemma-3-270m-q4_k_m`, `my-qwen`),
    a hub id as it is (`HuggingFaceTB/SmolLM2-135M-Instruct`)."""
    from pathlib import Path

    path = Path(spec)
    if spec.endswith(".gguf"):
        return path.stem
    if spec.startswith(("/", "./", "../", "~")) or path.is_dir():
        return path.resolve().name if spec in (".", "..") else path.name
    return spec


def parse(body: dict, model_id: str, chat: bool, default_max_tokens: int, default_temperature: float) -> Params:
    """Read a chat (`chat`) or completions request; Refused(400) names the first bad field."""
    model = body.get("model")
    if model is None:
        raise Refused(400, "model: this field is required", "model", "missing_field")
    if model != model_id:
        raise Refused(400, f"model: unknown model {json.dumps(model)}; this server serves {json.dumps(model_id)}",
                      "model", "model_not_found")
    prompt = _messages(body) if chat else _prompt(body)
    n = _integer(body, "n", 1)
    if n not in (None, 1):
        raise bad("n", f"this server returns one choice per request, got n={n}")
    max_tokens = _integer(body, "max_completion_tokens", 1) if chat else None
    max_tokens = max_tokens if max_tokens is not None else _integer(body, "max_tokens", 1)
    seed = _integer(body, "seed")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", f"must be a non-empty string or a list of at most {MAX_STOPS} of them")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise bad("stream_options", "must be an object like {\"include_usage\": true}")
    return Params(
        prompt=prompt,
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        temperature=_number(body, "temperature", default_temperature, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        seed=seed,
        stop=stop,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )
