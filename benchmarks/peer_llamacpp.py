#!/usr/bin/env python3
"""Peer benchmark: greedy decoding with llama.cpp (llama-cpp-python, low-level C API).

Runs INSIDE the peer virtualenv (benchmarks/.peer-venv, created by vs_llamacpp.py),
which has llama-cpp-python installed. It imports nothing from specdec but the provenance
writer (backend/bench/provenance.py, standard library only), found through the repository path.

    python peer_llamacpp.py --gguf MODEL.gguf --prompts prompts.jsonl \
        --max-new-tokens 64 --threads 2 --json out.json

For every prompt (JSON lines: {"id", "kind", "messages": [{"role", "content"}]}):

1. Render the chat template stored in the GGUF (metadata `tokenizer.chat_template`)
   with jinja2 exactly the way HF transformers' `apply_chat_template(...,
   add_generation_prompt=True)` does (sandboxed env, trim_blocks, lstrip_blocks,
   loopcontrols, same globals).
2. Tokenize with llama.cpp's tokenizer: add_special=False (no BOS: HF's
   apply_chat_template(tokenize=True) adds no special tokens either, and the SmolLM2
   GGUF says add_bos_token=false), parse_special=True (so "<|im_start|>" etc. become
   single special tokens).
3. Greedy-decode exactly N new tokens, EOS ignored (generation never stops early):
     prefill:  llama_decode() over the prompt tokens (chunks of n_batch), then argmax
               of the last position's logits -> new token #1.
     decode:   N-1 steps of { llama_decode(1 token = previous new token);
               argmax(logits) -> next new token }.
               (The N-th new token is sampled but not fed back: N new tokens cost
               exactly N-1 single-token forward passes.)

Timing (time.perf_counter, wall clock; the CPU backend's llama_decode is synchronous):
  prefill_ms           = [start of first prompt llama_decode .. argmax of token #1 done]
                          (i.e. time to first token, excluding tokenization/templating).
  decode_ms            = [end of prefill .. argmax of token #N done]
                          = sum of the N-1 decode steps; each step = llama_decode of one
                          token + fetching logits + numpy argmax over the vocab.
  decode_tokens_per_s  = (N - 1) / decode_ms * 1000   (decode-only: tokens after the first)
Overall:
  decode_tokens_per_s  = sum over prompts of (N-1) / sum of decode_ms
  median_ms_per_token  = median of all individual decode-step times (all prompts)
Context: n_ctx = smallest multiple of 256 >= longest prompt + N + 16, n_batch = n_ubatch
= 512, f16 KV cache, flash attention off by default (see --flash-attn), mmap'd weights.
The KV cache is cleared between prompts (no prefix reuse). One untimed warm-up
generation (first prompt, N tokens) runs before the timed pass.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np


def _request_amx() -> int:
    """Linux's tile permission for this process (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
    asked before llama.cpp loads, as specdec's kernel asks it: 0 granted, else the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    return 0 if libc.syscall(158, 0x1023, 18) == 0 else ctypes.get_errno()   # SYS_arch_prctl on x86-64


if "--request-amx" in sys.argv:       # before llama.cpp's import runs its CPU feature probes
    AMX_PERMISSION = _request_amx()
else:
    AMX_PERMISSION = None

import llama_cpp  # noqa: E402  (llama-cpp-python)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from backend.bench.provenance import write_result  # noqa: E402


# --------------------------------------------------------------------------------------
# logging: keep llama.cpp quiet except for warnings/errors
# --------------------------------------------------------------------------------------

_VERBOSE = False
_LAST_SHOWN = False


@llama_cpp.llama_log_callback
def _log_cb(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:  # pragma: no cover
    # ggml_log_level (ggml.h of the pinned llama.cpp):
    #   0 NONE, 1 DEBUG, 2 INFO, 3 WARN, 4 ERROR, 5 CONT (continuation of previous line)
    global _LAST_SHOWN
    show = _VERBOSE or level in (3, 4) or (level == 5 and _LAST_SHOWN)
    if level != 5:
        _LAST_SHOWN = show
    if show:
        try:
            sys.stderr.write(text.decode("utf-8", errors="replace"))
        except Exception:
            pass


def _install_logger(verbose: bool) -> None:
    global _VERBOSE
    _VERBOSE = verbose
    llama_cpp.llama_log_set(_log_cb, ctypes.c_void_p(0))


# --------------------------------------------------------------------------------------
# model metadata / chat template
# --------------------------------------------------------------------------------------


def meta_str(model, key: str) -> str | None:
    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, size)
        if n < 0:
            return None
        if n < size:
            return buf.value.decode("utf-8", errors="replace")
        size = n + 1


def token_text(vocab, tok: int) -> str:
    raw = llama_cpp.llama_vocab_get_text(vocab, tok)
    return raw.decode("utf-8", errors="replace") if raw else ""


def render_chat(template: str, messages: list[dict], bos_token: str, eos_token: str) -> str:
    """Render like transformers.utils.chat_template_utils (add_generation_prompt=True)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return _dt.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=True,
        bos_token=bos_token, eos_token=eos_token)


def tokenize(vocab, text: str, add_special: bool = False) -> list[int]:
    data = text.encode("utf-8")
    cap = len(data) + 16
    while True:
        arr = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), arr, cap,
                                     add_special,  # chat: no BOS/EOS added (the template writes them)
                                     True)   # parse_special: <|im_start|> -> special id
        if n >= 0:
            return list(arr[:n])
        cap = -n


def detokenize(vocab, toks: list[int]) -> str:
    out = bytearray()
    buf = ctypes.create_string_buffer(256)
    for t in toks:
        n = llama_cpp.llama_token_to_piece(vocab, t, buf, 256, 0, True)
        if n > 0:
            out += buf.raw[:n]
    return out.decode("utf-8", errors="replace")


# --------------------------------------------------------------------------------------
# generation
# --------------------------------------------------------------------------------------


class Runner:
    def __init__(self, model, ctx, vocab, n_vocab: int, n_batch: int):
        self.model = model
        self.ctx = ctx
        self.vocab = vocab
        self.n_vocab = n_vocab
        self.n_batch = n_batch
        self.mem = llama_cpp.llama_get_memory(ctx)
        self._one = (llama_cpp.llama_token * 1)()

    def _argmax_last(self) -> int:
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        return int(logits.argmax())

    def _decode(self, arr, n: int) -> None:
        rc = llama_cpp.llama_decode(self.ctx, llama_cpp.llama_batch_get_one(arr, n))
        if rc != 0:
            raise RuntimeError(f"llama_decode failed rc={rc} (n_tokens={n})")

    def generate(self, prompt_tokens: list[int], n_new: int) -> dict[str, Any]:
        llama_cpp.llama_memory_clear(self.mem, True)
        n_prompt = len(prompt_tokens)
        chunks = []
        for i in range(0, n_prompt, self.n_batch):
            part = prompt_tokens[i:i + self.n_batch]
            chunks.append(((llama_cpp.llama_token * len(part))(*part), len(part)))
        one = self._one
        decode = self._decode
        argmax = self._argmax_last
        step_s: list[float] = []
        pc = time.perf_counter

        # ---- prefill: prompt -> new token #1 ----
        t0 = pc()
        for arr, n in chunks:
            decode(arr, n)
        tok = argmax()
        t1 = pc()
        out = [tok]

        # ---- decode: N-1 single-token steps ----
        t_prev = t1
        for _ in range(n_new - 1):
            one[0] = tok
            decode(one, 1)
            tok = argmax()
            t = pc()
            step_s.append(t - t_prev)
            t_prev = t
            out.append(tok)
        t2 = t_prev

        prefill_s = t1 - t0
        decode_s = t2 - t1
        n_dec = n_new - 1
        return {
            "prompt_tokens": n_prompt,
            "new_tokens": len(out),
            "decode_steps": n_dec,
            "prefill_ms": prefill_s * 1e3,
            "prefill_tokens_per_s": n_prompt / prefill_s if prefill_s > 0 else None,
            "decode_ms": decode_s * 1e3,
            "decode_tokens_per_s": (n_dec / decode_s) if (n_dec > 0 and decode_s > 0) else None,
            "median_ms_per_token": statistics.median(step_s) * 1e3 if step_s else None,
            "step_ms": [round(s * 1e3, 4) for s in step_s],
            "token_ids": out,
        }


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", help="JSON lines file")
    ap.add_argument("--ids-json", default=None,
                    help="instead of --prompts: a JSON list of {\"id\", \"kind\", \"token_ids\"} fed as they are "
                         "(benchmarks/vs_llamacpp_scale.py: both engines get the same ids)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--flash-attn", choices=["auto", "on", "off"], default="off",
                    help="llama.cpp flash attention. Default off: llama.cpp's own default "
                         "'auto' turns it on for CPU, and on this 2-core box that measured "
                         "~30%% slower decode (~55 vs ~75 tok/s for SmolLM2-135M Q4_1), so "
                         "off is the stronger baseline")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--request-amx", action="store_true",
                    help="ask Linux for the AMX tile state before llama.cpp loads (a build with its AMX path)")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp logs")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")

    _install_logger(args.verbose)
    if (args.prompts is None) == (args.ids_json is None):
        ap.error("give --prompts or --ids-json")
    prompts = []
    if args.ids_json:
        with open(args.ids_json, encoding="utf-8") as f:
            prompts = json.load(f)
    else:
        with open(args.prompts, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    prompts.append(json.loads(line))
    if not prompts:
        print("no prompts", file=sys.stderr)
        return 2

    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    t_load0 = time.perf_counter()
    model = llama_cpp.llama_model_load_from_file(os.fsencode(args.gguf), mparams)
    if not model:
        print(f"failed to load model {args.gguf}", file=sys.stderr)
        return 2
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    template = meta_str(model, "tokenizer.chat_template")
    if not template:   # a base model: the messages' text as a plain continuation, with BOS
        print("GGUF has no tokenizer.chat_template: prompts are plain continuations", file=sys.stderr)
    bos_id = llama_cpp.llama_vocab_bos(vocab)
    eos_id = llama_cpp.llama_vocab_eos(vocab)
    bos_tok = token_text(vocab, bos_id) if bos_id >= 0 else ""
    eos_tok = token_text(vocab, eos_id) if eos_id >= 0 else ""

    items = []
    for p in prompts:
        if "token_ids" in p:
            items.append({"id": p.get("id"), "kind": p.get("kind"), "prompt_text": None,
                          "tokens": [int(x) for x in p["token_ids"]]})
            continue
        if template:
            text = render_chat(template, p["messages"], bos_tok, eos_tok)
            toks = tokenize(vocab, text)
        else:          # backend/bench/prompt_sets.py plain_text / prompt_ids
            text = "\n\n".join(m["content"] for m in p["messages"])
            toks = tokenize(vocab, text, add_special=True)
        items.append({"id": p.get("id"), "kind": p.get("kind"),
                      "prompt_text": text, "tokens": toks})

    n_new = args.max_new_tokens
    max_prompt = max(len(it["tokens"]) for it in items)
    n_ctx = ((max_prompt + n_new + 16 + 255) // 256) * 256

    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = args.n_batch
    cparams.n_ubatch = args.n_batch
    cparams.n_seq_max = 1
    cparams.n_threads = args.threads
    cparams.n_threads_batch = args.threads
    cparams.no_perf = False
    cparams.flash_attn_type = {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
                               "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                               "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}[args.flash_attn]
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        print("failed to create llama context", file=sys.stderr)
        return 2
    t_load = time.perf_counter() - t_load0
    runner = Runner(model, ctx, vocab, n_vocab, args.n_batch)

    desc = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(model, desc, 256)
    sysinfo = llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip()
    meta = {
        "engine": "llama.cpp",
        "llama_cpp_python_version": getattr(llama_cpp, "__version__", None),
        "system_info": sysinfo,
        "gguf": os.path.abspath(args.gguf),
        "model_desc": desc.value.decode("utf-8", errors="replace"),
        "model_size_bytes": int(llama_cpp.llama_model_size(model)),
        "model_n_params": int(llama_cpp.llama_model_n_params(model)),
        "n_vocab": n_vocab,
        "bos_token_id": bos_id, "eos_token_id": eos_id,
        "gguf_add_bos_token": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "tokenize": "add_special=False, parse_special=True" if template else "add_special=True, parse_special=True",
        "prompt_format": "chat template" if template else "plain continuation (no chat template)",
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
        "n_ctx": int(llama_cpp.llama_n_ctx(ctx)),
        "n_batch": int(llama_cpp.llama_n_batch(ctx)),
        "n_ubatch": int(llama_cpp.llama_n_ubatch(ctx)),
        "n_threads": args.threads, "n_threads_batch": args.threads,
        "flash_attn": args.flash_attn,
        "amx_permission": AMX_PERMISSION,
        "max_new_tokens": n_new,
        "ignore_eos": True,
        "sampling": "greedy argmax (numpy, first index on ties)",
        "timing": ("prefill_ms = prompt llama_decode(s) + argmax of new token #1; "
                   "decode = the remaining N-1 steps of llama_decode(1 token) + argmax; "
                   "decode_tokens_per_s = (N-1)/decode time; time.perf_counter wall clock"),
        "load_s": t_load,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "started_at": _dt.datetime.now().isoformat(timespec="seconds"),
        "loadavg_start": loadavg(),
        "prompts_file": os.path.abspath(args.prompts or args.ids_json),
        "n_prompts": len(items),
    }
    print(f"[peer] llama-cpp-python {meta['llama_cpp_python_version']}  model={meta['model_desc']}"
          f"  n_ctx={meta['n_ctx']} n_batch={meta['n_batch']} threads={args.threads}", flush=True)
    print(f"[peer] {sysinfo}", flush=True)
    print(f"[peer] loadavg at start: {meta['loadavg_start']}", flush=True)

    if not args.no_warmup:
        t = time.perf_counter()
        runner.generate(items[0]["tokens"], n_new)
        meta["warmup_s"] = time.perf_counter() - t

    llama_cpp.llama_perf_context_reset(ctx)
    per_prompt = []
    for it in items:
        r = runner.generate(it["tokens"], n_new)
        r["text"] = detokenize(vocab, r["token_ids"])
        per_prompt.append({"id": it["id"], "kind": it["kind"], **r,
                           "prompt_token_ids": it["tokens"]})
    perf = llama_cpp.llama_perf_context(ctx)
    meta["loadavg_end"] = loadavg()
    import resource
    meta["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024    # weights mmapped

    tot_dec_tokens = sum(r["decode_steps"] for r in per_prompt)
    tot_dec_s = sum(r["decode_ms"] for r in per_prompt) / 1e3
    all_steps = [s for r in per_prompt for s in r["step_ms"]]
    tot_prompt_tokens = sum(r["prompt_tokens"] for r in per_prompt)
    tot_prefill_s = sum(r["prefill_ms"] for r in per_prompt) / 1e3
    overall = {
        "decode_tokens_per_s": tot_dec_tokens / tot_dec_s if tot_dec_s > 0 else None,
        "median_ms_per_token": statistics.median(all_steps) if all_steps else None,
        "mean_ms_per_token": statistics.fmean(all_steps) if all_steps else None,
        "total_decode_tokens": tot_dec_tokens,
        "total_decode_s": tot_dec_s,
        "total_new_tokens": sum(r["new_tokens"] for r in per_prompt),
        "total_prompt_tokens": tot_prompt_tokens,
        "total_prefill_s": tot_prefill_s,
        "prefill_tokens_per_s": tot_prompt_tokens / tot_prefill_s if tot_prefill_s > 0 else None,
        "median_prefill_ms": statistics.median(r["prefill_ms"] for r in per_prompt),
        # llama.cpp's own internal counters over the timed pass (cross-check; these
        # count only the graph compute inside llama_decode, not Python/argmax overhead)
        "llama_perf": {"t_p_eval_ms": perf.t_p_eval_ms, "n_p_eval": perf.n_p_eval,
                       "t_eval_ms": perf.t_eval_ms, "n_eval": perf.n_eval},
    }
    result = {"meta": meta, "overall": overall, "per_prompt": per_prompt}

    # ---- table ----
    hdr = f"{'id':<28} {'kind':<8} {'p_tok':>6} {'new':>4} {'prefill_ms':>10} {'dec_tok/s':>9} {'med_ms':>7}"
    print(hdr)
    print("-" * len(hdr))
    for r in per_prompt:
        print(f"{str(r['id'])[:28]:<28} {str(r['kind'])[:8]:<8} {r['prompt_tokens']:>6} "
              f"{r['new_tokens']:>4} {r['prefill_ms']:>10.1f} "
              f"{(r['decode_tokens_per_s'] or 0):>9.1f} {(r['median_ms_per_token'] or 0):>7.2f}")
    print("-" * len(hdr))
    print(f"overall decode-only: {overall['decode_tokens_per_s']:.1f} tok/s "
          f"({tot_dec_tokens} tokens in {tot_dec_s:.3f} s), median {overall['median_ms_per_token']:.2f} ms/token, "
          f"mean {overall['mean_ms_per_token']:.2f} ms/token")
    print(f"prefill: {overall['prefill_tokens_per_s']:.1f} tok/s overall, median {overall['median_prefill_ms']:.1f} ms/prompt")
    print(f"llama.cpp internal: eval {perf.n_eval} tok in {perf.t_eval_ms:.1f} ms "
          f"({(perf.n_eval / perf.t_eval_ms * 1e3) if perf.t_eval_ms else 0:.1f} tok/s), "
          f"prompt {perf.n_p_eval} tok in {perf.t_p_eval_ms:.1f} ms")
    print(f"loadavg start {meta['loadavg_start']} end {meta['loadavg_end']}")

    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        write_result(args.json_out, result, args.threads)       # date, machine, commit, command
        print(f"[peer] wrote {args.json_out}")

    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
