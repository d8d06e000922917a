import asyncio, signal, torch, logging
from connector.embedded import EmbeddedCluster
from connector import ECConnector
from connector.client import async_client
with EmbeddedCluster(3, 1) as c:
    ec = ECConnector(c.url, "fp", mode="cluster", registry=None)
    hs=[f"f{i}" for i in range(12)]
    for h in hs: ec.put(h, torch.ones(2))
    async def main():
        r = async_client(c.url, mode="cluster")
        print(await r.exists(ec.key("f0")))
        v = c.masters[0]; v.child.signal(signal.SIGKILL); v.child.proc.wait()
        a = await asyncio.gather(*(r.exists(ec.key(h)) for h in hs), return_exceptions=True)
        print([repr(x)[:80] for x in a])
        a = await asyncio.gather(*(r.exists(ec.key(h)) for h in hs), return_exceptions=True)
        print([repr(x)[:80] for x in a])
        await r.aclose()
    asyncio.run(main())
