"""The process that renders chat templates for ``template_guard``: a script of its own (run as
``python -I template_worker.py MEMORY_BYTES CPU_SECONDS``), importing only transformers' renderer, so a template
that loops or grows without end spends this process's time and memory, never the app's.

It renders with transformers' own ``render_jinja_template`` (jinja2's ``ImmutableSandboxedEnvironment`` with
transformers' filters and globals), so a template renders here exactly as ``apply_chat_template`` would render it.
Requests and replies are one JSON object a line on stdin and stdout: ``{"template", "messages",
"add_generation_prompt", "variables", "max_chars"}`` in, ``{"text"}`` or ``{"error"}`` out; a first line
``{"ready": true}`` says the renderer is loaded. The address space is capped at what the renderer took to load
plus ``MEMORY_BYTES``, and the process's whole CPU time at ``CPU_SECONDS``, so it ends on its own even when the
app that started it is gone.
"""

from __future__ import annotations

import json
import sys


def _limit_resources(memory_bytes: int, cpu_seconds: int) -> None:
    try:
        import resource
    except ImportError:  # not POSIX: the app's time limit still applies
        return
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        size = 512 * 2**20
    for limit, value in ((resource.RLIMIT_AS, size + memory_bytes), (resource.RLIMIT_CPU, cpu_seconds)):
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):
            pass


def _render(render, request: dict) -> dict:
    try:
        rendered, _ = render(conversations=[request["messages"]], chat_template=request["template"],
                             add_generation_prompt=bool(request["add_generation_prompt"]),
                             **request["variables"])
        text = rendered[0]
    except MemoryError:
        return {"error": "it needs more memory than a chat template is allowed"}
    except RecursionError:
        return {"error": "it recurses too deeply"}
    except Exception as exc:  # noqa: BLE001 - a template's own failure is its answer
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    if len(text) > request["max_chars"]:
        return {"error": f"it wrote {len(text)} characters; at most {request['max_chars']} are allowed"}
    return {"text": text}


def main(argv: list[str]) -> None:
    memory_bytes, cpu_seconds = int(argv[1]), int(argv[2])
    from transformers.utils.chat_template_utils import render_jinja_template

    _limit_resources(memory_bytes, cpu_seconds)
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            reply = _render(render_jinja_template, json.loads(line))
            text = json.dumps(reply)
        except MemoryError:
            text = json.dumps({"error": "it needs more memory than a chat template is allowed"})
        except Exception as exc:  # noqa: BLE001 - a malformed request
            text = json.dumps({"error": f"bad request: {exc}"[:500]})
        out.write(text + "\n")
        out.flush()


if __name__ == "__main__":
    main(sys.argv)
