"""`qwen-image-fast serve`: OpenAI's Images API over the fast pipeline, with dynamic batching and per-request LoRAs.

    main.py       the command: options checked, engines started, uvicorn run, SIGTERM drain
    protocol.py   the request fields (OpenAI's, SGLang's and vLLM-Omni's names) -> ImageRequest; the error object
    app.py        FastAPI routes, API key, body limits, timeouts and disconnects
    scheduler.py  dynamic batching over the engines; an engine that stops fails its requests with 503 and restarts
    engine.py     one engine process: loads the pipeline, warms it up, runs batches (cli.run.run_batch)
    metrics.py    /metrics in Prometheus' text format
    page.html     the page at / (render, and render two settings side by side with PSNR / SSIM)
"""
