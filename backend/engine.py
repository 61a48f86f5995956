"""Assemble a SpecDecoder from an engine directory: runtime, tokenizer, drafters, controller.

Used by the Triton adapters, the offline benchmarks, the build's checks and tests, so every
path builds the decoder the same way from the manifest (the only source of truth at serve time).
"""
from __future__ import annotations

from backend.config import DrafterKind, RemoteDraft, RuntimeOptions, ServeConfig, SpecConfig
from backend.controller import AdaptiveController, Controller, CostModel, FixedController
from backend.decoder import SpecDecoder
from backend.drafters.base import Drafter
from backend.manifest import EngineManifest
from backend.devices import load_runtime
from backend.tokenizer import Tokenizer


def make_drafters(manifest: EngineManifest, spec: SpecConfig, options: RuntimeOptions | None = None,
                  remote: RemoteDraft | None = None, kinds: set | None = None) -> dict[DrafterKind, Drafter]:
    """Every drafter the manifest can run (or those of `kinds`), kind by kind (draft_kinds.KINDS):
    prompt lookup always, and what each kind built; with `remote`, the node's kind drafts on a
    draft node instead (drafters/remote.py), prompt lookup its fallback."""
    from backend import draft_kinds

    want = lambda k: kinds is None or k in kinds
    drafters: dict[DrafterKind, Drafter] = {}
    for kind in draft_kinds.KINDS:
        drafters.update(kind.make(manifest, spec, options, drafters, want))
        if remote is not None and DrafterKind.PROMPT_LOOKUP in drafters and remote.kind not in drafters:
            drafters[remote.kind] = remote_drafter(remote, spec, drafters[DrafterKind.PROMPT_LOOKUP])
    return drafters


def remote_drafter(remote: RemoteDraft, spec: SpecConfig, fallback):
    """The node's drafter, with its traits (cost entry "remote", priced at start, see
    make_controller) and the gRPC transport."""
    from dataclasses import replace

    from backend.drafters.draft_model import DraftModelDrafter
    from backend.drafters.eagle import EagleDrafter
    from backend.drafters.remote import RemoteDrafter
    from backend.drafters.remote_grpc import draft_node_transport

    if remote.kind is DrafterKind.EAGLE:
        traits = EagleDrafter.make_traits(spec.eagle_depth, spec.max_tree_nodes)
    elif remote.kind is DrafterKind.DRAFT_MODEL:
        traits = DraftModelDrafter.make_traits(spec.max_draft_tokens)
    else:
        raise ValueError(f"a draft node runs draft-model or eagle, not {remote.kind.value!r}")
    return RemoteDrafter(remote.kind.value, replace(traits, cost_key=REMOTE_COST_KEY),
                         draft_node_transport(resolve_url(remote.url), remote.timeout_s), fallback,
                         retry_s=remote.retry_s)


REMOTE_COST_KEY = "remote"


def resolve_url(url: str) -> str:
    """`local` is this server's own gRPC endpoint (set by `specdec serve` in SPECDEC_GRPC_URL)."""
    import os

    if url == "local":
        if "SPECDEC_GRPC_URL" not in os.environ:
            raise ValueError("remote_draft 'local' needs SPECDEC_GRPC_URL (set by `specdec serve`); "
                             "give the node's host:port instead")
        return os.environ["SPECDEC_GRPC_URL"]
    return url


def _remote_price(drafter, manifest: EngineManifest) -> tuple[float, float]:
    """(seconds per draft forward, per catch-up token) of a draft node, until measured online:
    one empty call times the round trip (a node that does not answer is priced at 50 ms); the
    node's compute is priced as the same drafter would be here, where the build measured it."""
    import time

    t0 = time.perf_counter()
    try:
        drafter.transport({"kind": drafter.kind, "rows": [], "released": []}, None)
        trip = time.perf_counter() - t0
    except Exception:
        trip = 0.05
    local = CostModel.from_json(manifest.cost_model) if manifest.cost_model else None
    step = local.draft_step_s.get(drafter.kind, 0.0) if local else 0.0
    catch = local.catch_up_s.get(drafter.kind, 1e-4) if local else 1e-4
    return step + trip / max(1, drafter.traits.max_forwards), catch


def make_controller(manifest: EngineManifest, spec: SpecConfig,
                    drafters: dict[DrafterKind, Drafter]) -> Controller:
    """The adaptive controller over the build's cost model, unless the server fixes K (or the
    build measured no costs). Fails (UnpricedDrafter) if a drafter has no cost entry; a draft
    node's entry is priced here, at start (the controller then corrects it by measured time)."""
    if spec.num_draft_tokens is None and manifest.cost_model:
        cost = CostModel.from_json(manifest.cost_model)
        for d in drafters.values():
            if d.traits.cost_key == REMOTE_COST_KEY and REMOTE_COST_KEY not in cost.draft_step_s:
                cost.draft_step_s[REMOTE_COST_KEY], cost.catch_up_s[REMOTE_COST_KEY] = _remote_price(d, manifest)
        return AdaptiveController({k: d.traits for k, d in drafters.items()}, cost)
    return FixedController(spec)


def enable_prefix_caches(budget_mb: float, target, drafters: dict[DrafterKind, Drafter]) -> None:
    """Prefix caches (prefix_cache.py) on the target and on the runtimes of the drafters with a
    model (a draft model, an EAGLE head), splitting `budget_mb` between them by their KV bytes
    per token (so each holds as many tokens). A runtime without slots (ONNX Runtime's groups)
    keeps none: its drafter catches up over the whole prompt, as the controller prices it."""
    from backend.drafters.draft_model import DraftModelDrafter
    from backend.drafters.eagle import EagleDrafter

    models = [d.rt for d in drafters.values() if isinstance(d, (DraftModelDrafter, EagleDrafter))]
    runtimes = [rt for rt in dict.fromkeys([target] + models) if hasattr(rt, "enable_prefix_cache")]
    if budget_mb <= 0 or not runtimes:
        return
    per_token = [rt.block_storage().block_bytes(1) for rt in runtimes]
    for rt, b in zip(runtimes, per_token):
        rt.enable_prefix_cache(int(budget_mb * 2 ** 20 * b / sum(per_token)))


def make_decoder(cfg: ServeConfig, manifest: EngineManifest | None = None) -> SpecDecoder:
    manifest = manifest or EngineManifest.load(cfg.engine_dir)
    target = load_runtime(manifest, cfg.weight_format, options=cfg.runtime)
    drafters = make_drafters(manifest, cfg.spec, cfg.runtime, cfg.remote_draft)
    enable_prefix_caches(cfg.prefix_cache_mb, target, drafters)
    return SpecDecoder(target, Tokenizer.from_manifest(manifest), drafters, cfg.spec,
                       make_controller(manifest, cfg.spec, drafters), prefill_chunk=cfg.prefill_chunk)
