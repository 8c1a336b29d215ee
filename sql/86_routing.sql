-- 86_routing.sql: where a workspace's calls run best, for callers that send them there.
--
-- On a Citus cluster every node has the cluster's metadata and answers any call (Citus routes
-- each statement to the node holding the workspace), but a call made on the node that holds
-- its workspace runs every statement there, locally, and leaves the coordinator out
-- (docs/scaling.md, "Routing"). These two functions tell a caller, in any language, where that
-- is, from Citus's metadata (pg_dist_placement, pg_dist_node): connect to host:port with the
-- same user and database, unless `here` says the node asked is already the one. On one server
-- they answer `here` and no node: nothing to route. A route may go stale when an operator moves
-- shards; a call sent by a stale route is still answered right (Citus routes it on), and asking
-- again on that node tells where the workspace is now.

create function memory_private.is_distributed() returns boolean
  language plpgsql stable
  as $$
begin
  if not exists (select 1 from pg_extension where extname = 'citus') then
    return false;
  end if;
  return exists (select 1 from pg_dist_partition
                  where logicalrelid = 'memory_private.workspaces'::regclass);
end
$$;
comment on function memory_private.is_distributed() is
  'True when the schema is distributed on a Citus cluster (memory_private.workspaces is a '
  'distributed table; every node has that metadata), false on plain PostgreSQL or before '
  'memory_private.distribute().';

create function memory.workspace_node(
  p_workspace_id text, out host text, out port integer, out here boolean
) returns record
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
begin
  perform memory_private.check_id('workspace_id', p_workspace_id);
  if not memory_private.is_distributed() then
    here := true;  -- one server: it holds every workspace
    return;
  end if;
  -- The node of the workspace's shard group, if it is an active primary with the metadata (a
  -- node without it cannot plan the call); none: stay where you are.
  select n.nodename, n.nodeport, n.groupid = (select groupid from pg_dist_local_group)
    into host, port, here
    from pg_dist_placement p
    join pg_dist_node n on n.groupid = p.groupid
   where p.shardid = get_shard_id_for_distribution_column('memory_private.workspaces',
                                                           p_workspace_id)
     and n.noderole = 'primary' and n.isactive and n.hasmetadata
   order by n.groupid = (select groupid from pg_dist_local_group) desc, n.nodeid
   limit 1;
  here := coalesce(here, false);
end
$$;
comment on function memory.workspace_node(text) is
  'Where to send a workspace''s calls: on a Citus cluster, the host and port of the node '
  'holding it (from Citus''s metadata) and whether that is the node asked (here); on one server '
  'no host and here true. A call sent anywhere is answered right; sent there, its statements '
  'run on that node alone. MB001 for an invalid workspace id. docs/scaling.md, "Routing".';

create function memory.workspace_nodes()
  returns table (host text, port integer, here boolean)
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
begin
  if not memory_private.is_distributed() then
    return query select null::text, null::integer, true;
    return;
  end if;
  return query
  select n.nodename::text, n.nodeport::integer,
         n.groupid = (select groupid from pg_dist_local_group)
    from pg_dist_node n
   where n.noderole = 'primary' and n.isactive and n.hasmetadata
     and exists (select 1 from pg_dist_placement p join pg_dist_shard s on s.shardid = p.shardid
                  where p.groupid = n.groupid
                    and s.logicalrelid = 'memory_private.workspaces'::regclass)
   order by n.nodename, n.nodeport;
end
$$;
comment on function memory.workspace_nodes() is
  'The nodes that hold workspaces (on a Citus cluster: active primaries with shards of '
  'memory_private.workspaces, host, port and whether it is the node asked); on one server a '
  'single row with no host and here true. A worker claims on each in turn: memory.claim_job '
  'called on a worker node picks among the workspaces it holds. docs/scaling.md, "Routing".';

revoke all on function memory.workspace_node(text), memory.workspace_nodes() from public;
grant execute on function memory.workspace_node(text)
  to memory_backend, memory_worker, memory_operator;
grant execute on function memory.workspace_nodes() to memory_worker, memory_operator;
