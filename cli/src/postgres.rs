//! Databases of their own on a PostgreSQL server, for one benchmark run or
//! one test: created fresh beside the server's other databases and dropped
//! afterwards. `reservoir bench` and the process tests (two central
//! replicas over one database) use them.

use tokio_postgres::{Client, NoTls};

/// `url` with its database replaced by `database`.
pub fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority_start = base.find("://").map_or(0, |at| at + 3);
    let root = match base[authority_start..].find('/') {
        Some(at) => &base[..authority_start + at],
        None => base,
    };
    match query {
        Some(query) => format!("{root}/{database}?{query}"),
        None => format!("{root}/{database}"),
    }
}

/// A client of `url`; its connection runs on a task of its own.
pub async fn connect(url: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// Creates `database` on the server of `url` (dropping an old one of that
/// name first) and returns its URL.
pub async fn create_database(url: &str, database: &str) -> Result<String, tokio_postgres::Error> {
    let client = connect(url).await?;
    client
        .batch_execute(&format!("DROP DATABASE IF EXISTS {database}"))
        .await?;
    client
        .batch_execute(&format!("CREATE DATABASE {database}"))
        .await?;
    Ok(with_database(url, database))
}

/// Drops `database` on the server of `url`, closing the connections still
/// open to it.
pub async fn drop_database(url: &str, database: &str) -> Result<(), tokio_postgres::Error> {
    let client = connect(url).await?;
    client
        .batch_execute(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
        .await
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn the_database_is_replaced_and_the_rest_kept() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/postgres", "b"),
            "postgres://postgres@127.0.0.1:5432/b"
        );
        assert_eq!(
            with_database("postgres://u@h:1?sslmode=disable", "b"),
            "postgres://u@h:1/b?sslmode=disable"
        );
    }
}
