"""The speculative decoding engine: no Ray, no HTTP. ``core.SpecEngine`` (continuous batching,
one step = admit -> plan -> propose -> verify -> commit), its phases, the scheduler and its
registry, the draft planner, the target runner and KV pool, rejection sampling, target and drafter
loading (``builder``), chat templates, detokenizing and metrics. The Ray Serve application
(``serve/app.py``) and the pipeline are its clients."""
