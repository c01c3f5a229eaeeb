"""The stateful side of pagedserve: KV pool, scheduler, model runner, sampler, session server."""
