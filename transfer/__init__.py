"""cube-transfer (watch donefiles, build, roll out) and cube-local (a loopback cluster).

Pure decisions: `config` (transfer.conf), `donefile` (line parsing), `state` (versions, chain,
quorum, catch-up plans), `views` (JSON shapes). Shells: `journal` (durable state), `build`
(cube-builder subprocess and output checks), `agents` (agent HTTP client, one command driven to an
outcome), `service` (the rollout loop), `http_api` (query API and file server), `main`
(cube-transfer), `local` (cube-local). The agent side of the protocol is docs/ROLLOUT.md.
"""
