//! A writer the test keeps a handle to, to read back what a logging adaptor wrote.

use std::io::{self, Write};
use std::sync::{Arc, Mutex};

/// An in-memory writer whose clones share one buffer.
#[derive(Clone, Debug, Default)]
pub struct SharedBuf(Arc<Mutex<Vec<u8>>>);

impl SharedBuf {
    /// Everything written so far.
    pub fn bytes(&self) -> Vec<u8> {
        self.0.lock().unwrap().clone()
    }

    /// Everything written so far, as UTF-8.
    pub fn text(&self) -> String {
        String::from_utf8(self.bytes()).unwrap()
    }
}

impl Write for SharedBuf {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
