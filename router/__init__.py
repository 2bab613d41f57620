"""The router: OpenAI requests in, placed on prefill and decode workers, token streams back out.

Three rooms, by stage, importing one way (surface -> upstream -> decision):
- `router/surface/`: the OpenAI surface (request bodies, templates, tools, structured outputs, rendering);
- `router/upstream/`: the calls to workers (the generate call, its answers, migration);
- `router/decision/`: where a request goes (workers, loads, prefix locality, admission, placement).
At the top: the app's wiring (app, runtime, routes, middleware, main, settings) and what every room
shares (errors, metrics, timeline, wire)."""
