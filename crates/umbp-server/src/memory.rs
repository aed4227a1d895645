//! CUDA memory of clients, opened in the server (filled in with the CUDA IPC importers).

/// A client's CUDA allocation opened here by its legacy IPC handle.
#[derive(Debug)]
pub(crate) struct IpcImport;

/// CUDA memory of a client mapped into the server.
#[derive(Debug)]
pub(crate) enum CudaBacking {
    /// Part of an allocation opened by IPC handle (shared by the session's registrations in
    /// it: the allocation is opened once per session).
    Ipc(std::sync::Arc<IpcImport>),
}

use tonic::Status;
use umbp_proto::v1;

use crate::service::State;
use crate::sessions::ClientSession;

/// Opens a client's CUDA allocation by its legacy IPC handle and registers the range.
pub(crate) fn register_ipc(
    _st: &State,
    _cs: &ClientSession,
    _r: v1::RegisterCudaIpcRequest,
) -> Result<v1::RegisterMemoryReply, Status> {
    Err(Status::unimplemented(
        "CUDA IPC registration is not built in yet",
    ))
}

/// Maps a client's exported virtual-memory allocations and registers the range.
pub(crate) fn register_vmm(
    _st: &State,
    _cs: &ClientSession,
    _r: v1::RegisterCudaVmmRequest,
) -> Result<v1::RegisterMemoryReply, Status> {
    Err(Status::unimplemented(
        "CUDA VMM registration is not built in yet",
    ))
}
