//! The hosts that serve the wire: the source host ([`source`]) and the services it serves
//! beside its memory source — the job queue ([`queue`]), retention ([`sweeps`]) and a
//! JetStream bucket ([`jetstream`]). They live outside turmoil's hosts where they must
//! survive a crash, like a disk, and tell the checks what they serve.

pub mod jetstream;
pub mod queue;
pub mod source;
pub mod sweeps;
