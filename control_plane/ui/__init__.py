"""The web console at /ui: server-rendered pages over the same services the API controllers call.

Sign-in turns a read or admin token into a signed session cookie (`session`); pages are Jinja templates
(`templates/`), refreshed in place by htmx; htmx and Chart.js are vendored under `static/` and served by
the control plane itself, so the console works offline. Read tokens see, admin tokens act.
"""
