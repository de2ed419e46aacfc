"""The ground floor: what every part of the engine stands on and nothing of the course above it.

``types`` (the shared vocabulary: requests, sequences, the errors, the memory-manager protocol), ``env`` (device,
profiles, banner), ``device_discipline`` (a GPU's rules on a CPU), ``host_copy`` (step metadata to the device
without a wait), ``state`` (an object's state captured and put back), ``progress`` (a bar for a wait).
Imports only each other (the architecture test holds this)."""
