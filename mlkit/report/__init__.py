"""The reproduced report (docs/report.md): its figures, and its figures beside ours.

``figures`` holds what the report states (decode tok/s, KV tokens, weights per GPU),
``deployments`` its two deployments and the request shapes of their sweeps, which the
analytic model, the deviceless H200 compiles and the experiments all read, so that each
is written down once. ``comparison`` builds REPORT.md's opening table from the
experiments' JSON records.
"""
