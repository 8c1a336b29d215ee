"""The reference Telegram bot: aiogram 3 on top of :mod:`pyworker.client` (``pimem telegram``).

Needs the ``telegram`` extra (``pip install 'pimem[telegram]'``); the worker never imports it.
docs/telegram.md describes the set-up, how Telegram maps onto the memory, and what the bot does
not do. :mod:`~pyworker.contrib.telegram.mapping` holds the mapping,
:mod:`~pyworker.contrib.telegram.chat` the chat model with the two memory tools,
:mod:`~pyworker.contrib.telegram.bot` the bot itself; what the database refuses goes through
:mod:`~pyworker.contrib.telegram.redelivery` (an update delivered again, or given up),
:mod:`~pyworker.contrib.telegram.polling` (the offset kept before it) and
:mod:`~pyworker.contrib.telegram.outbox` (a request's end kept until the database takes it).
"""
