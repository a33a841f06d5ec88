"""Tools over a whole fleet: `pagefleet up` (every role as local processes) and
`pagefleet bench serve` (a load generator). The only layer above the roles."""
