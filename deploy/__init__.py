"""iterserve.deploy: the Ray Serve application around the engine.

Modules (imported on demand; nothing is imported here):
    app          build_app(args) -> Application, AppArgs   (`serve run iterserve.deploy.app:build_app`)
    ingress      OpenAIIngress: the FastAPI ingress deployment
    settings     AppArgs (what the user gave) -> resolve_app -> AppSettings (resolved once)
    replica      LLMReplica: one AsyncLLMEngine per replica; its ReplicaLoad for router/autoscaler
    server       create_app(client, settings): the FastAPI app (auth dependency, errors)
    routes       the routes: every one behind the API key except /health, /live and /metrics
    lifecycle    ServingState, DrainGate: an ingress's drain flag and requests in flight
    handlers     completions / chat completions: engine streams -> bodies and SSE chunks
    protocol     OpenAI bodies <-> token ids, SamplingParams, RequestOutput deltas
    schemas      pydantic models of every HTTP body
    errors       OpenAI-shaped errors; engine and Ray errors -> HTTP statuses
    engine_client HandleEngineClient (Serve handle) and LocalEngineClient (in-process engine)
    engine_info  describe_engine, stream_engine (shared replica-side helpers)
    auth         API keys
    cli, cli_serve  the `iterserve` console script and `iterserve serve`
    shutdown     how `iterserve serve` stops: SIGTERM / SIGINT drain, a second signal at once
"""
