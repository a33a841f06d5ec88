"""CPU choices made by measurement on the machine that serves: the linear path per weight shape
(`--linear-path`), kept per CPU model and logged with the reason."""
