"""The small HTTP/1.1 server and client shared by the router, the simulator and the benchmarks.

``server`` serves the router's API and the simulated engines'; ``client`` is the pooled
keep-alive client the router forwards with and the live benchmarks drive load with. Both know
HTTP only: what a request means is their callers' business.

Named ``kvroute.http``: every import in the project is absolute (``from kvroute.http...``),
so this package never shadows the standard library's ``http``, which ``server`` itself uses.
"""
