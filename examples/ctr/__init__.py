"""ElasticCTR around Cube: click logs -> streaming trainer -> base/delta embeddings rolled out by
cube-transfer -> a CTR predictor that looks the embeddings up in Cube (README.md).

Modules, in the order data flows:

- `samples`: the `$show $click $feasign:$slot ...` line format, parsed into numpy arrays;
- `data`: a synthetic click-log stream with a planted ground truth, in the streaming layout
  `data/<YYYYMMDD>/<HHMM>/part-*` + a donefile per split;
- `model`: sum-pooled per-slot embeddings + a small MLP, in numpy (forward, backward, AUC);
- `trainer`: streaming training; saves `base` (daily, after shrink) and `delta` models as Cube
  SequenceFiles + dense parameters + donefile lines;
- `predictor`: HTTP JSON service: one batched Cube lookup per request, the dense part of the
  same version, CTRs and the version used;
- `client`: replays a held-out split against the predictor (AUC, QPS, p99);
- `demo`: all of it with a local cluster (`make demo-ctr`).
"""
