"""What the tests share: processes they start (servers, agents, file servers, moto), inputs
they build, the multi-host harness (clustersim) and its relay. Imported as `helpers.<module>`
(pytest puts tests/ on the path); the harness scripts also run by path (docs/DEPLOY.md)."""
