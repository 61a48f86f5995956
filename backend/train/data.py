"""Data for the draft head, labelled by the target itself.

1. responses: the target answers prompts (continuous batching through the same SpecDecoder the
   server uses; the fastest weight format; greedy and sampled). Appended to a JSON-lines file as
   they finish, so an interrupted run resumes. Fixed text (corpus.py) gives records of the same
   form without generating.
2. features: the serving-format target is run teacher-forced over prompt + response; for every
   position we keep its final-norm feature (fp16); its next-token distribution is recomputed
   from that feature at training time. Written in shards; existing shards are skipped on resume.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np


def _bar(total: int, desc: str, unit: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)


def generate_responses(engine_dir: Path, prompts: list[list[dict]], out_path: Path, fmt: str,
                       max_new: int = 160, batch: int = 16, sampled_fraction: float = 0.3,
                       seed: int = 0, max_prompt: int = 900) -> list[dict]:
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
                    ids = tok.encode(tok.apply_chat_template(prompts[i]), add_special_tokens=False)[-max_prompt:]
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


def extract_hidden(engine_dir: Path, records: list[dict], out_dir: Path, fmt: str = "fp32",
                   shard_size: int = 256, probe_every: int = 8, feature_layers: tuple[int, ...] = ()) -> list[Path]:
    """Teacher-forced features without stored labels (the corpus path, corpus.py).

    Per shard: tokens, final-norm features (fp16) of every position, and at every
    `probe_every`-th position the target's full-vocabulary argmax (`probe_pos`, `probe_top1`),
    which chooses the draft vocabulary. Training recomputes the target's distribution over the
    draft vocabulary from the stored features (logits = feature @ lm_head rows), so only
    1/probe_every of the rows pay for the full LM head here. One forward per record. With
    `feature_layers` (EAGLE-3) each row is [final norm | the inputs of those layers]."""
    from backend.manifest import EngineManifest
    from backend.devices import load_runtime

    out_dir.mkdir(parents=True, exist_ok=True)
    shards = [records[i: i + shard_size] for i in range(0, len(records), shard_size)]
    paths = [out_dir / f"hidden_{k:04d}.npz" for k in range(len(shards))]
    if all(p.exists() for p in paths):
        return paths
    m = EngineManifest.load(engine_dir)
    rt = load_runtime(m, fmt, feature_layers=feature_layers or None)     # None: the engine's own
    width = m.model.hidden_size * (1 + len(feature_layers))                # what is stored of `hidden`
    total = sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in records)
    bar = _bar(total, "features", "tok")
    for path, shard in zip(paths, shards):
        n = sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in shard)
        if path.exists():
            bar.update(n)
            continue
        tokens, feats, offsets, plens, probe_pos, probe_top1 = [], [], [0], [], [], []
        for rec in shard:
            ids = np.asarray(rec["prompt_ids"] + rec["output_ids"], np.int64)[: rt.max_seq_len]
            t = ids.size
            rows = np.arange(0, t, probe_every)
            rt.alloc(0)
            out = rt.forward([0], ids[None], np.arange(-1, t - 1, dtype=np.int32)[None], rows[None])
            probe_top1.append(out.logits[0].argmax(-1).astype(np.int32))
            probe_pos.append((rows + offsets[-1]).astype(np.int64))
            feats.append(out.hidden[0, :, :width].astype(np.float16))
            rt.free(0)
            tokens.append(ids.astype(np.int32))
            offsets.append(offsets[-1] + t)
            plens.append(len(rec["prompt_ids"]))
            bar.update(t)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=np.concatenate(tokens), feats=np.concatenate(feats),
                 offsets=np.asarray(offsets, np.int64), prompt_lens=np.asarray(plens, np.int64),
                 probe_pos=np.concatenate(probe_pos), probe_top1=np.concatenate(probe_top1))
        tmp.rename(path)
    bar.close()
    rt.close()
    return paths
