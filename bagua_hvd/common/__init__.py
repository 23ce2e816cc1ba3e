"""Framework-neutral layer shared by every frontend (torch, tensorflow): the core library binding,
basics (init/rank/size), process sets, exceptions, helpers and the op layer."""
