"""iterserve.deploy: the Ray Serve application around the engine.

Modules (imported on demand; nothing is imported here):
    app          build_app(args) -> Application, AppArgs   (`serve run iterserve.deploy.app:build_app`)
    ingress      OpenAIIngress: the FastAPI ingress deployment
    replica      LLMReplica: one AsyncLLMEngine per replica; load_signals for router/autoscaler
    server       create_app(client, settings): the FastAPI app (routes, auth, limits, errors)
    handlers     completions / chat completions: engine streams -> bodies and SSE chunks
    protocol     OpenAI bodies <-> token ids, SamplingParams, RequestOutput deltas
    schemas      pydantic models of every HTTP body
    errors       OpenAI-shaped errors; engine and Ray errors -> HTTP statuses
    engine_client HandleEngineClient (Serve handle) and LocalEngineClient (in-process engine)
    engine_info  load_signals, describe_engine, stream_engine (shared replica-side helpers)
    auth         API keys
    cli, cli_serve  the `iterserve` console script and `iterserve serve`
"""
