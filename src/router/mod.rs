//! Routing policies over the structures (placeholder until the routers land).
