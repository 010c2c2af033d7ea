"""Shared helpers of the engine tests (no tests here)."""


def run_engine(engine, on_step=None) -> dict:
    """Step to the end, checking the cache's invariants after every step; returns
    {request_id: final RequestOutput}. on_step(engine) runs after each step."""
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.cache.check_invariants()
        if on_step is not None:
            on_step(engine)
    return final
