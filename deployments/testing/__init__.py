"""What the tests and benchmarks drive a stack with: `stack` (the services on free ports, in
temp dirs), `load` (closed- and open-loop load through a route), `drive` (a route held and
configured by hand) and `watch` (a deployment's runs and a route's status, read from outside,
as an operator would)."""
