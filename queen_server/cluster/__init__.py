"""The pieces queen replicas share (issue 18): the bus (``bus``), the directory of replicas,
workers and per-model capacity (``directory``), and the cross-replica job path (``stream``,
``remote``). With no Redis, the in-process implementations stand behind the same protocols, so
one queen works exactly as before. Nothing here imports the HTTP edge or the app."""
