"""The ``kvroute`` command line: one entry point, one module per command group.

Each command group lives in ``kvroute/commands/<group>.py`` and owns its own options; this
file only assembles them, so adding a command never edits another command's code.
"""

from __future__ import annotations

import typer

from kvroute.commands import audit as audit_cmd
from kvroute.commands import bench as bench_cmd
from kvroute.commands import bench_overhead as bench_overhead_cmd
from kvroute.commands import bench_soak as bench_soak_cmd
from kvroute.commands import demo as demo_cmd
from kvroute.commands import epp as epp_cmd
from kvroute.commands import events as events_cmd
from kvroute.commands import gate as gate_cmd
from kvroute.commands import hash as hash_cmd
from kvroute.commands import plan as plan_cmd
from kvroute.commands import serve as serve_cmd
from kvroute.commands import sim as sim_cmd

app = typer.Typer(
    name="kvroute",
    help="A KV-cache-aware router for LLM inference fleets.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command(name="audit", help=audit_cmd.HELP)(audit_cmd.audit_cmd)
app.command(name="demo", help=demo_cmd.HELP)(demo_cmd.demo)
app.command(name="hash", help=hash_cmd.HELP)(hash_cmd.hash_tokens)
app.command(name="serve", help=serve_cmd.HELP)(serve_cmd.serve)
app.command(name="epp", help=epp_cmd.HELP)(epp_cmd.epp)
app.command(name="plan", help=plan_cmd.HELP)(plan_cmd.plan)
bench_cmd.bench_app.command(name="overhead", help=bench_overhead_cmd.HELP)(
    bench_overhead_cmd.bench_overhead)
bench_cmd.bench_app.command(name="soak", help=bench_soak_cmd.HELP)(bench_soak_cmd.bench_soak)
app.add_typer(bench_cmd.bench_app, name="bench")
app.add_typer(events_cmd.events_app, name="events")
app.add_typer(gate_cmd.gate_app, name="gate")
app.add_typer(sim_cmd.sim_app, name="sim")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":  # `python -m kvroute.cli ...` runs the same commands as `kvroute`
    main()
