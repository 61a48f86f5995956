"""Self-distillation data for the draft head, made by the target itself.

1. responses: the target answers the training prompts (continuous batching through the same
   SpecDecoder the server uses; the fastest weight format; greedy and sampled). Appended to a
   JSON-lines file as they finish, so an interrupted run resumes.
2. features: the serving-format target is run teacher-forced over prompt + response; for every
   position we keep its final-norm feature (fp16) and the target's top-k next-token
   distribution (ids and probabilities, unordered). Written in shards; existing shards are skipped on resume.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np

TOPK = 8


def _bar(total: int, desc: str, unit: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)


def generate_responses(engine_dir: Path, prompts: list[list[dict]], out_path: Path, fmt: str,
                       max_new: int = 160, batch: int = 16, sampled_fraction: float = 0.3,
                       seed: int = 0) -> list[dict]:
    from backend.config import DrafterKind, SamplingParams, ServeConfig, SpecConfig
    from backend.engine import make_decoder
    from backend.sequence import Request

    done = {}
    if out_path.exists():
        for line in out_path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                done[rec["i"]] = rec
    todo = [i for i in range(len(prompts)) if i not in done]
    if todo:
        dec = make_decoder(ServeConfig(engine_dir=str(engine_dir), weight_format=fmt,
                                       spec=SpecConfig(auto_drafter=DrafterKind.NONE)))
        tok, rng = dec.tok, random.Random(seed)
        bar = _bar(len(prompts), "responses", "prompt")
        bar.update(len(done))
        active = []
        with open(out_path, "a") as f:
            def finish(i, seq):
                rec = {"i": i, "prompt_ids": list(seq.prompt_ids), "output_ids": seq.output_ids}
                f.write(json.dumps(rec) + "\n")
                f.flush()
                done[i] = rec
                dec.finish(seq)
                bar.update(1)

            while todo or active:
                while todo and len(active) < batch:
                    i = todo.pop(0)
                    ids = tok.encode(tok.apply_chat_template(prompts[i]), add_special_tokens=False)[-900:]
                    temp = 0.8 if rng.random() < sampled_fraction else 0.0
                    seq = dec.start(Request(tuple(ids), SamplingParams(temperature=temp, top_p=0.95,
                                                                       max_tokens=max_new, seed=i),
                                            DrafterKind.NONE))
                    out = None
                    while out is None:
                        out = dec.prefill(seq)
                    if seq.finished:
                        finish(i, seq)
                    else:
                        active.append((i, seq))
                if not active:
                    continue
                dec.step([s for _, s in active])
                for i, seq in [a for a in active if a[1].finished]:
                    finish(i, seq)
                active = [a for a in active if not a[1].finished]
        bar.close()
    return [done[i] for i in sorted(done)]


def extract_features(engine_dir: Path, records: list[dict], out_dir: Path, fmt: str = "fp32",
                     shard_size: int = 64, chunk: int = 512) -> list[Path]:
    from backend.manifest import EngineManifest
    from backend.runtime import load_runtime

    out_dir.mkdir(parents=True, exist_ok=True)
    shards = [records[i: i + shard_size] for i in range(0, len(records), shard_size)]
    paths = [out_dir / f"features_{k:04d}.npz" for k in range(len(shards))]
    if all(p.exists() for p in paths):
        return paths
    rt = load_runtime(EngineManifest.load(engine_dir), fmt)
    total = sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in records)
    bar = _bar(total, "features", "tok")
    for path, shard in zip(paths, shards):
        n = sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in shard)
        if path.exists():
            bar.update(n)
            continue
        tokens, feats, top_ids, top_p, offsets, plens = [], [], [], [], [0], []
        for rec in shard:
            ids = np.asarray(rec["prompt_ids"] + rec["output_ids"], np.int64)
            rt.alloc(0)
            for a in range(0, ids.size, chunk):
                part = ids[a: a + chunk]
                t = part.size
                out = rt.forward([0], part[None], np.arange(-1, t - 1, dtype=np.int32)[None], np.arange(t)[None])
                logits = out.logits[0]
                idx = np.argpartition(-logits, TOPK, axis=-1)[:, :TOPK]
                z = logits - logits.max(-1, keepdims=True)
                p = np.exp(z)
                p /= p.sum(-1, keepdims=True)
                top_ids.append(idx.astype(np.int32))
                top_p.append(np.take_along_axis(p, idx, -1).astype(np.float16))
                feats.append(out.hidden[0].astype(np.float16))
                rt.commit([0], [np.arange(t)])
                bar.update(t)
            rt.free(0)
            tokens.append(ids.astype(np.int32))
            offsets.append(offsets[-1] + ids.size)
            plens.append(len(rec["prompt_ids"]))
        np.savez(path, tokens=np.concatenate(tokens), feats=np.concatenate(feats),
                 top_ids=np.concatenate(top_ids), top_p=np.concatenate(top_p),
                 offsets=np.asarray(offsets, np.int64), prompt_lens=np.asarray(plens, np.int64))
    bar.close()
    rt.close()
    return paths
