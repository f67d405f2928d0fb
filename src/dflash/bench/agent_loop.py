"""Agent-loop benchmark: replay a session's calls against a cold server (no prefix cache) and a warm one.

At every assistant turn of the transcript the exact prefix the agent sent then is sent again, streamed, greedy,
to both servers (cold first, then warm, call by call, so slow drifts of a shared machine hit both alike). Each
server first answers one short warm-up call, which is not recorded. With no separate cold server, cold calls go
to the warm server with the prefix cache switched off for the request (`cache_prompt: false` and the
`X-DFlash-Prefix-Cache: off` header; servers other than dflash may ignore both).

Per call it records time to first token, total time, prompt / cached / completion tokens and the answer; the
summary gives totals, the warm/cold ratio of time to first token over the long prefixes, empty answers and
whether both servers gave the same answers.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from dflash.bench.chat_stream import CallRecord, stream_chat
from dflash.bench.transcript import Message, Transcript

OPT_OUT_HEADERS = {"X-DFlash-Prefix-Cache": "off"}
WARM_UP = [{"role": "user", "content": "Reply with the single word OK."}]


@dataclass(frozen=True)
class ReplaySettings:
    base_url: str  # the warm server
    cold_base_url: str | None = None  # None: the warm server with the prefix cache off per request
    model: str = "any"
    max_tokens: int = 64
    send_tools: bool = True
    long_prefix_tokens: int = 7500  # prompts at least this long make the "long prefix" figures
    timeout_s: float = 600.0


def replay(transcript: Transcript, settings: ReplaySettings,
           on_call: Callable[[int, int, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    calls = transcript.calls()
    rows: list[dict[str, Any]] = []
    with httpx.Client(timeout=settings.timeout_s) as client:
        servers = {"warm": _server_card(client, settings.base_url),
                   "cold": _server_card(client, settings.cold_base_url or settings.base_url)}
        cold_url, cold_headers, cold_extra = _cold_target(settings)
        stream_chat(client, settings.base_url, _body(settings, WARM_UP, [], {"cache_prompt": False}), OPT_OUT_HEADERS)
        if settings.cold_base_url:
            stream_chat(client, cold_url, _body(settings, WARM_UP, [], {}))
        tools = transcript.tools if settings.send_tools else []
        for index, prefix in enumerate(calls):
            cold = stream_chat(client, cold_url, _body(settings, prefix, tools, cold_extra), cold_headers)
            warm = stream_chat(client, settings.base_url, _body(settings, prefix, tools, {}))
            row = _row(index, prefix, cold, warm)
            rows.append(row)
            if on_call is not None:
                on_call(index, len(calls), row)
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),
        "transcript": {"source": transcript.source, "format": transcript.format,
                       "messages": len(transcript.messages), "calls": len(calls), "tools": len(transcript.tools)},
        "settings": {"base_url": settings.base_url, "cold_base_url": settings.cold_base_url, "model": settings.model,
                     "max_tokens": settings.max_tokens, "temperature": 0, "send_tools": settings.send_tools,
                     "long_prefix_tokens": settings.long_prefix_tokens},
        "servers": servers,
        "calls": rows,
        "totals": summarise(rows, settings.long_prefix_tokens),
    }


def summarise(rows: list[dict[str, Any]], long_prefix_tokens: int) -> dict[str, Any]:
    def total(side: str, key: str) -> float:
        return round(sum(r[side][key] or 0.0 for r in rows), 3)

    long_rows = [r for r in rows if (r["prompt_tokens"] or 0) >= long_prefix_tokens and r["ttft_ratio"] is not None]
    long_ratios = [r["ttft_ratio"] for r in long_rows]
    cold_ttft, warm_ttft = total("cold", "ttft_s"), total("warm", "ttft_s")
    return {
        "calls": len(rows),
        "cold_ttft_s": cold_ttft, "warm_ttft_s": warm_ttft,
        "ttft_ratio": round(warm_ttft / cold_ttft, 4) if cold_ttft else None,
        "cold_total_s": total("cold", "total_s"), "warm_total_s": total("warm", "total_s"),
        "cold_completion_tokens": int(total("cold", "completion_tokens")),
        "warm_completion_tokens": int(total("warm", "completion_tokens")),
        "warm_cached_tokens": int(total("warm", "cached_tokens")),
        "prompt_tokens": int(sum(r["prompt_tokens"] or 0 for r in rows)),
        "empty_answers": {"cold": sum(r["cold"]["empty"] for r in rows), "warm": sum(r["warm"]["empty"] for r in rows)},
        "errors": {"cold": sum(r["cold"]["error"] is not None for r in rows),
                   "warm": sum(r["warm"]["error"] is not None for r in rows)},
        "identical_answers": sum(r["same_answer"] for r in rows),
        "acceptance_length": {"cold": _mean_acceptance(rows, "cold"), "warm": _mean_acceptance(rows, "warm")},
        "long_prefix": {
            "min_prompt_tokens": long_prefix_tokens, "calls": len(long_rows),
            "max_ttft_ratio": round(max(long_ratios), 4) if long_ratios else None,
            "median_ttft_ratio": round(statistics.median(long_ratios), 4) if long_ratios else None,
        },
    }


def format_table(result: dict[str, Any]) -> str:
    head = (f"{'call':>4} {'msgs':>5} {'prompt':>7} {'cached':>7} {'cold ttft':>10} {'warm ttft':>10} {'warm/cold':>10} "
            f"{'cold total':>11} {'warm total':>11} {'tokens':>7} {'same':>5}")
    lines = [head]
    for r in result["calls"]:
        cold, warm = r["cold"], r["warm"]
        lines.append(
            f"{r['call']:>4} {r['messages']:>5} {_int(r['prompt_tokens']):>7} {_int(warm['cached_tokens']):>7} "
            f"{_sec(cold['ttft_s']):>10} {_sec(warm['ttft_s']):>10} {_ratio(r['ttft_ratio']):>10} "
            f"{_sec(cold['total_s']):>11} {_sec(warm['total_s']):>11} {warm['completion_tokens']:>7} "
            f"{'yes' if r['same_answer'] else 'NO':>5}"
            + (f"  cold error: {cold['error']}" if cold["error"] else "")
            + (f"  warm error: {warm['error']}" if warm["error"] else "")
            + ("  EMPTY (warm)" if warm["empty"] else "") + ("  EMPTY (cold)" if cold["empty"] else "")
        )
    t = result["totals"]
    long = t["long_prefix"]
    lines += [
        f"totals over {t['calls']} calls: time to first token cold {t['cold_ttft_s']:.2f} s, warm {t['warm_ttft_s']:.2f} s "
        f"(warm/cold {_ratio(t['ttft_ratio'])}); total time cold {t['cold_total_s']:.2f} s, warm {t['warm_total_s']:.2f} s",
        f"prompts of {long['min_prompt_tokens']}+ tokens: {long['calls']} calls, warm/cold time to first token "
        f"median {_ratio(long['median_ttft_ratio'])}, max {_ratio(long['max_ttft_ratio'])}",
        f"empty answers: cold {t['empty_answers']['cold']}, warm {t['empty_answers']['warm']}; errors: cold "
        f"{t['errors']['cold']}, warm {t['errors']['warm']}; identical answers {t['identical_answers']}/{t['calls']}",
        f"acceptance length (server timings): cold {_ratio(t['acceptance_length']['cold'])}, "
        f"warm {_ratio(t['acceptance_length']['warm'])}",
    ]
    return "\n".join(lines)


def _mean_acceptance(rows: list[dict[str, Any]], side: str) -> float | None:
    """Mean of the per-call acceptance lengths the server reported (speculative calls only)."""
    values = [r[side]["acceptance_length"] for r in rows if r[side].get("acceptance_length")]
    return round(statistics.fmean(values), 4) if values else None


def _row(index: int, prefix: list[Message], cold: CallRecord, warm: CallRecord) -> dict[str, Any]:
    ratio = None
    if cold.ttft_s and warm.ttft_s is not None:
        ratio = round(warm.ttft_s / cold.ttft_s, 4)
    return {
        "call": index, "messages": len(prefix),
        "prompt_tokens": warm.prompt_tokens if warm.prompt_tokens is not None else cold.prompt_tokens,
        "ttft_ratio": ratio,
        "same_answer": cold.error is None and warm.error is None and cold.answer() == warm.answer(),
        "cold": cold.as_dict(), "warm": warm.as_dict(),
    }


def _body(settings: ReplaySettings, messages: list[Message], tools: list[dict[str, Any]],
          extra: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": settings.model, "messages": messages, "max_tokens": settings.max_tokens,
                            "temperature": 0, **extra}
    if tools:
        body["tools"] = tools
    return body


def _cold_target(settings: ReplaySettings) -> tuple[str, dict[str, str] | None, dict[str, Any]]:
    if settings.cold_base_url:
        return settings.cold_base_url, None, {}
    return settings.base_url, OPT_OUT_HEADERS, {"cache_prompt": False}


def _server_card(client: httpx.Client, base_url: str) -> dict[str, Any]:
    try:
        models = client.get(f"{base_url.rstrip('/')}/v1/models").json().get("data") or [{}]
    except (httpx.HTTPError, ValueError):
        models = [{}]
    return {"base_url": base_url, "model": models[0]}


def _machine() -> dict[str, Any]:
    """The machine the client ran on (the servers' too when they listen on loopback)."""
    out: dict[str, Any] = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                           "cpu_count": os.cpu_count(), "python": platform.python_version()}
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        out["dflash"] = importlib.metadata.version("dflash-server")
    try:
        import torch

        out["torch"] = torch.__version__
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return out


def _int(value: int | None) -> str:
    return "-" if value is None else str(value)


def _sec(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
