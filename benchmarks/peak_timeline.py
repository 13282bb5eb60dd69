"""Where a forward+backward's peak GPU memory comes, all-GPU against the layered offload variants.

    python benchmarks/peak_timeline.py --out peaks.json            # the 7B shape of offload_bench.py
    python benchmarks/peak_timeline.py --quick --out peaks.json    # 4 layers, short sequences

The pass is cut into intervals at each decoder layer's output (forward: after the layer; backward:
when the gradient of that output is ready, i.e. before the layer's backward) and at the loss.
For each interval the allocator's peak inside it is recorded (torch's counters are kept on the
host as the kernels are queued, so they are what the peak of the pass is made of). It also times
each variant's forward+backward, so a setting that lowers the peak shows what it costs. Two passes
are cut: a step's first micro-batch (no gradients yet) and its second (gradient accumulation: the
first one's gradients are held).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload_bench import FULL_PLAN, GIB, LAYERED, QUICK_PLAN, Bench, machine  # noqa: E402

from trainer.offload import OffloadOptions, attach_offload  # noqa: E402

VARIANTS = {
    "all-GPU": None,
    "layered, head streamed": OffloadOptions(),
    "layered, head streamed, 4 head gradient chunks in flight": OffloadOptions(head_grads_in_flight=4),
    "layered, whole head prefetched": OffloadOptions(head_slots=1 << 10),
}


class Timeline:
    """Peak and current allocated GiB per interval of one pass, cut at marks."""

    def __init__(self) -> None:
        self.marks: list[dict] = []
        self.last = "start"

    def mark(self, label: str) -> None:
        self.marks.append({"interval": f"{self.last} -> {label}",
                           "peak_gib": torch.cuda.max_memory_allocated() / GIB,
                           "allocated_gib": torch.cuda.memory_allocated() / GIB})
        torch.cuda.reset_peak_memory_stats()
        self.last = label

    def watch(self, model) -> list:
        """Forward hooks on every decoder layer: a mark after its forward, and a gradient hook on its
        output that marks when the backward reaches it."""
        handles = []
        for index, layer in enumerate(model.model.layers):
            def after(module, args, output, index=index):
                self.mark(f"forward layer {index}")
                hidden = output[0] if isinstance(output, tuple) else output
                if hidden.requires_grad:
                    hidden.register_hook(lambda grad: self.mark(f"backward reaches layer {index}"))
            handles.append(layer.register_forward_hook(after))
        return handles


def run_variant(bench: Bench, name: str, options: OffloadOptions | None, iters: int) -> dict:
    model = bench.build()
    engine = None if options is None else attach_offload(model, LAYERED, bench.device, role="actor", options=options)
    ids = bench.ids()
    step = bench.forward_backward(model, ids)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / iters * 1e3

    passes = {}
    # The first micro-batch of a step starts with no gradients; the second (gradient accumulation)
    # with the first one's: an all-GPU model then holds every gradient through its peak, the
    # offloaded groups' gradients are on the host.
    for pass_name in ("first micro-batch", "second micro-batch"):
        timeline = Timeline()
        handles = timeline.watch(model)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = model(input_ids=ids, labels=ids).loss
        timeline.mark("loss")
        loss.backward()
        timeline.mark("end of backward")
        for handle in handles:
            handle.remove()
        torch.cuda.synchronize()
        peak = max(timeline.marks, key=lambda mark: mark["peak_gib"])
        passes[pass_name] = {"peak_gib": peak["peak_gib"], "peak_interval": peak["interval"], "marks": timeline.marks}
    for parameter in model.parameters():
        parameter.grad = None
    if engine is not None:
        engine.close()
    del model, engine
    return {"name": name, "forward_backward_ms": ms, "passes": passes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="4 layers, short sequences")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("ERROR: peak_timeline.py needs a CUDA GPU (none visible to torch)", file=sys.stderr)
        return 2
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    bench = Bench(plan, args.out)
    results = [run_variant(bench, name, options, plan.iters) for name, options in VARIANTS.items()]
    args.out.write_text(json.dumps({"machine": machine(), "batch": [plan.batch, plan.tokens], "variants": results},
                                   indent=1))
    for result in results:
        print(f"{result['name']:<58} f+b {result['forward_backward_ms']:7.1f} ms")
        for pass_name, pass_ in result["passes"].items():
            print(f"  {pass_name:<20} peak {pass_['peak_gib']:6.2f} GiB in [{pass_['peak_interval']}]")
            for mark in pass_["marks"]:
                if mark["interval"].endswith(("-> loss", "reaches layer 27", "reaches layer 0", "end of backward")):
                    print(f"    {mark['interval']:<56} peak {mark['peak_gib']:6.2f}  "
                          f"then {mark['allocated_gib']:6.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
