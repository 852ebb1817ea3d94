"""The experiment kit: run folders and checkpoints, the runner (seeds, threads, progress,
resumable training), sweeps over worker processes or Ray, statistics over seeds, reports, and the
experiment protocol that the command line is generated from. The reproductions in
`sharpattn.experiments` are its clients."""
