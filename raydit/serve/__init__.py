"""`raydit serve`: an HTTP video service on Ray Serve speaking OpenAI's Videos API.

Modules: `config` (options and serve.yaml), `auth` (the bearer token), `schema` (request
bodies and limits), `store` (videos and status JSON on disk), `service` (queue, engine,
metrics), `app` (FastAPI on Ray Serve; imports Ray Serve), `launch` (the command), `page`
(the HTML page at /). Nothing here is imported by `import raydit`.
"""
