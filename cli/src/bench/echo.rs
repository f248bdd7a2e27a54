//! The ceiling for any HTTP service on the agent's socket: axum over a Unix
//! socket answering each request with its own body, nothing else. Served by
//! `reservoir bench --serve-echo PATH` in its own process, on the runtime
//! the agent uses by default (`agent_runtime(1)`), so that the ratios
//! compare the agent's work and not two runtimes.

use std::io::Write as _;
use std::path::Path;

use anyhow::Context as _;
use axum::Router;
use axum::body::Bytes;
use axum::routing::post;

/// Serves `POST /echo` on `socket` until the process is killed.
pub fn serve(socket: &Path) -> anyhow::Result<()> {
    crate::agent_runtime(1)?.block_on(async {
        let _ = std::fs::remove_file(socket);
        let listener = tokio::net::UnixListener::bind(socket)
            .with_context(|| format!("cannot listen on {}", socket.display()))?;
        let app = Router::new().route("/echo", post(|body: Bytes| async move { body }));
        let mut stdout = std::io::stdout();
        writeln!(stdout, "listening on {}", socket.display())?;
        stdout.flush()?;
        axum::serve(listener, app).await?;
        Ok(())
    })
}
