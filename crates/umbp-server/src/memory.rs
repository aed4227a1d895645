//! CUDA memory of clients, opened in the server: legacy IPC handles (one open per session and
//! allocation, shared by that session's registrations in it) and virtual-memory allocations
//! whose exported descriptors the client passed over the side channel. Closed when the
//! registration (or the session) goes.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use tonic::Status;
use umbp_core::ErrorKind;
use umbp_cuda::{device_by_uuid, format_uuid, ImportedIpc, ImportedVmm};
use umbp_proto::errors::status;
use umbp_proto::v1;

use crate::refusal::status_of;
use crate::sessions::{Backing, ClientSession, CudaBacking, IpcImport};
use crate::state::State;

fn device(d: &Option<v1::CudaDevice>) -> Result<i32, Status> {
    let uuid: [u8; 16] = d
        .as_ref()
        .map(|d| d.uuid.as_slice())
        .unwrap_or_default()
        .try_into()
        .map_err(|_| {
            status(
                ErrorKind::InvalidArgument,
                "device.uuid must be the device's 16-byte UUID",
            )
        })?;
    device_by_uuid(&uuid).map_err(|e| {
        status(ErrorKind::Registration, format!(
            "CUDA device {} is not visible to the server ({e}); run the server where it sees every GPU of the node (no CUDA_VISIBLE_DEVICES restriction; in a container, the same GPUs and --ipc=host)",
            format_uuid(&uuid)
        ))
    })
}

fn range_in(offset: u64, length: u64, total: u64) -> Result<(), Status> {
    if length == 0 || offset.checked_add(length).is_none_or(|e| e > total) {
        return Err(status(
            ErrorKind::Registration,
            format!("range {offset}+{length} does not lie inside the {total} bytes mapped"),
        ));
    }
    Ok(())
}

/// Opens a client's CUDA allocation by its legacy IPC handle and registers the range.
pub(crate) fn register_ipc(
    _st: &State,
    cs: &ClientSession,
    r: v1::RegisterCudaIpcRequest,
) -> Result<v1::RegisterMemoryReply, Status> {
    let handle: [u8; 64] = r.handle.as_slice().try_into().map_err(|_| {
        status(
            ErrorKind::InvalidArgument,
            format!(
                "handle has {} bytes; a CUDA IPC handle has 64",
                r.handle.len()
            ),
        )
    })?;
    range_in(r.offset, r.length, r.allocation_bytes)?;
    let dev = device(&r.device)?;
    let cached = cs.res.lock().ipc.get(&handle).and_then(|w| w.upgrade());
    let import = match cached {
        Some(i) if i.0.len() >= r.allocation_bytes => i,
        _ => {
            let opened = ImportedIpc::open(dev, &handle, r.allocation_bytes).map_err(|e| {
                status(ErrorKind::Registration, format!(
                    "cannot open the CUDA IPC handle: {e}; the allocation may have been freed, or the handle is not one of this node"
                ))
            })?;
            let i = Arc::new(IpcImport(opened));
            cs.res.lock().ipc.insert(handle, Arc::downgrade(&i));
            i
        }
    };
    let addr = import.0.addr() + r.offset;
    // SAFETY: the allocation stays opened (the Arc is kept with the registration's backing)
    // until the registration is gone.
    let id = unsafe { cs.session.register_cuda_memory(addr, r.length, dev) }
        .map_err(|e| status_of(&e))?;
    cs.res
        .lock()
        .backings
        .insert(id, Backing::Cuda(CudaBacking::Ipc(import)));
    tracing::debug!(
        session = cs.id,
        region = id,
        device = dev,
        bytes = r.length,
        "CUDA memory registered by IPC handle"
    );
    Ok(v1::RegisterMemoryReply {
        region_id: id,
        length: r.length,
    })
}

/// Maps a client's exported virtual-memory allocations and registers the range.
pub(crate) fn register_vmm(
    _st: &State,
    cs: &ClientSession,
    r: v1::RegisterCudaVmmRequest,
) -> Result<v1::RegisterMemoryReply, Status> {
    if r.chunks.is_empty() {
        return Err(status(
            ErrorKind::InvalidArgument,
            "a VMM registration needs at least one chunk",
        ));
    }
    let dev = device(&r.device)?;
    // Every ticket is taken (and its descriptor closed after mapping) whatever happens.
    // Their charges go when this returns, after the descriptors (declared first: dropped
    // last).
    let mut _charges = Vec::with_capacity(r.chunks.len());
    let mut fds: Vec<(OwnedFd, u64, u64)> = Vec::with_capacity(r.chunks.len());
    let mut missing = None;
    for c in &r.chunks {
        match cs.take_ticket(c.ticket) {
            Some((fd, charge)) => {
                fds.push((fd, c.offset, c.size));
                _charges.push(charge);
            }
            None => missing = missing.or(Some(c.ticket)),
        }
    }
    if let Some(t) = missing {
        return Err(status(ErrorKind::NotFound, format!(
            "descriptor ticket {t} is unknown to session {} (send the descriptors over the side channel first; each ticket is used once)",
            cs.id
        )));
    }
    let borrowed: Vec<_> = fds.iter().map(|(fd, o, s)| (fd.as_fd(), *o, *s)).collect();
    let mapped = ImportedVmm::map(dev, &borrowed).map_err(|e| {
        status(
            ErrorKind::Registration,
            format!("cannot map the exported CUDA allocations: {e}"),
        )
    })?;
    drop(borrowed);
    drop(fds);
    range_in(r.offset, r.length, mapped.len())?;
    let addr = mapped.addr() + r.offset;
    // SAFETY: the mapping is kept with the registration's backing until it is gone.
    let id = unsafe { cs.session.register_cuda_memory(addr, r.length, dev) }
        .map_err(|e| status_of(&e))?;
    cs.res
        .lock()
        .backings
        .insert(id, Backing::Cuda(CudaBacking::Vmm(mapped)));
    tracing::debug!(
        session = cs.id,
        region = id,
        device = dev,
        chunks = r.chunks.len(),
        bytes = r.length,
        "CUDA memory registered by exported descriptors"
    );
    Ok(v1::RegisterMemoryReply {
        region_id: id,
        length: r.length,
    })
}
