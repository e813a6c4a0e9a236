"""`loraplane adapters|engines|stats|audit`: the admin CLI, a client of the control plane's HTTP API.

One module per command group (adapters, engines, stats, audit), each a click group or command with
`main(argv) -> int` for shared.cli's dispatch table; what they share: where the control plane is and
with which token (config), the HTTP calls and their exit codes (client), tables and --json (render).
Nothing here imports the control plane's server side: the CLI runs in the torch-free base install and
against any control plane it can reach.
"""
