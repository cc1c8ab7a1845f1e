"""The HTTP routes, one module a family, each with `register(app, rt)`:

- `gate`: what every request passes (the bearer key, the drain gate, the error format);
- `service`: the server itself (health, metrics, the model list, runtime status);
- `responses`: the Responses API (create, input token counts, get, delete, cancel, input items);
- `chat`: the stateless chat-completions API;
- `sessions`: a principal's sessions (purge one, save checkpoints now).

`server/app.py` builds the app and registers them in that order.
"""
